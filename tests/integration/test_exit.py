"""A finished process exits 0 whatever torch's C++ threads are doing at that moment."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# A thread inside torch's C++ code (GIL released) when the process ends: plain interpreter exit aborts with
# "terminate called without an active exception" when that thread next takes the GIL, as gloo's worker threads
# can after a run's last collective.
SCRIPT = textwrap.dedent("""
    import atexit, threading, torch
    from automodel_ckpt.distributed.env import end_process, init_distributed, shutdown_distributed

    init_distributed()
    a = torch.randn(1200, 1200)
    busy = threading.Event()

    def work():
        busy.set()
        while True:
            a @ a

    threading.Thread(target=work, daemon=True).start()
    finished = []
    joined = threading.Thread(target=lambda: finished.append(sum(range(10**6))))
    joined.start()
    atexit.register(lambda: print("exit handler ran, joined thread done:", bool(finished), flush=True))
    busy.wait()
    print("last line", end="")
    shutdown_distributed()
    END
""")

# Every verb (consolidate.sh runs one under torchrun) ends a rank of a multi-process job the same way.
ENDINGS = {
    "end_process": "end_process(0)",
    "verb_rank": "import os; os.environ['WORLD_SIZE'] = '2'; from automodel_ckpt.cli import exit_code; exit_code(0); "
                 "raise SystemExit('exit_code returned: the interpreter would finalize')",
}


@pytest.mark.parametrize("ending", sorted(ENDINGS))
def test_end_process_exits_zero_with_torch_threads_busy(ending: str) -> None:
    script = SCRIPT.replace("END", ENDINGS[ending])
    for _ in range(3):
        proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "terminate called" not in proc.stderr
        assert proc.stdout.startswith("last line")  # flushed although the process skips interpreter teardown
        assert "exit handler ran, joined thread done: True" in proc.stdout


@pytest.mark.slow
def test_soak_30_runs_beside_cpu_hog(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "soak_exit.py"), "--runs", "30",
                           "--work", str(tmp_path)], capture_output=True, text=True, timeout=5400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "30 of 30 runs exited 0" in proc.stdout
