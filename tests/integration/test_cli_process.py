"""Process-level checks of the command line and of signal handling: the real executables, in subprocesses."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RECIPE = str(REPO / "recipes" / "tiny_llama_sft.yaml")


def test_no_traceback_from_the_real_command(tmp_path):
    exe = Path(sys.executable).parent / "ckpt-train"
    proc = subprocess.run([str(exe), RECIPE, "--step_scheduler.max_stepz", "3"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "Traceback" not in proc.stderr


def test_a_second_signal_stops_a_single_process(tmp_path):
    """Without the launcher, the first signal asks for a save; a second one is the signal's default action."""
    script = (
        "import os, signal\n"
        "from automodel_ckpt.training.save_triggers import PreemptionWatcher\n"
        "w = PreemptionWatcher('SIGTERM', repeat_stops=True); w.install()\n"
        "os.kill(os.getpid(), signal.SIGTERM); print('requested', w.requested, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGTERM); print('still alive', flush=True)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.stdout.splitlines() == ["requested True"]
    assert proc.returncode == -signal.SIGTERM
