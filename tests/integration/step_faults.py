"""A fine-tuning recipe whose rank 0 stops itself (SIGSTOP) once a given step is logged, for a test to act then.

``STOP_AFTER_STEP`` is the step, ``STOP_PID_FILE`` the file rank 0 writes its pid to before it stops (as it begins
the next step: that step's record, its save and its validation are done). Once the file exists no process stops
again (a later launch of the same run). The other ranks wait in the next step's collectives, so the whole job is
held at one known point: a kill lands mid-run whatever the machine's load, and a SIGTERM sent then is seen at the
next step boundary once the test resumes rank 0 (SIGCONT).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from automodel_ckpt.recipes.llm_finetune import FinetuneRecipe

RECIPE = "tests.integration.step_faults.StopAfterStepRecipe"


class StopAfterStepRecipe(FinetuneRecipe):
    """``FinetuneRecipe`` whose rank 0 stops after step ``STOP_AFTER_STEP`` (see the module)."""

    def train_step(self, micro):
        stop, pid_file = os.environ.get("STOP_AFTER_STEP"), os.environ.get("STOP_PID_FILE")
        if stop and pid_file and self.env.is_main and self.step_scheduler.step == int(stop) \
                and not os.path.exists(pid_file):
            with open(pid_file + ".tmp", "w") as out:
                out.write(str(os.getpid()))
            os.rename(pid_file + ".tmp", pid_file)
            os.kill(os.getpid(), signal.SIGSTOP)
        return super().train_step(micro)


def env(step: int, pid_file: Path) -> dict[str, str]:
    """The environment that makes a launch of ``RECIPE`` stop after ``step`` (``PYTHONPATH``: the tests' package)."""
    return {"STOP_AFTER_STEP": str(step), "STOP_PID_FILE": str(pid_file),
            "PYTHONPATH": str(Path(__file__).resolve().parents[2])}


def stopped(pid_file: Path, proc: subprocess.Popen) -> int | None:
    """The pid written to ``pid_file`` (by this recipe, or by another fault hook) once that process is stopped; None
    if the job ended first."""
    while proc.poll() is None:
        try:
            pid = int(pid_file.read_text())
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T":
                return pid
        except (OSError, ValueError):
            pass
        time.sleep(0.01)  # polling for the moment, not waiting for time: the process stops itself
    return None
