"""Workers die with their launcher: parent-death signal, the launcher gone before the worker bound, the watchdog."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
TIMEOUT = 60  # generous: the worker goes within about a second
WORKER = textwrap.dedent("""
    import time
    from automodel_ckpt.distributed.lifeline import bind_to_launcher
    bind_to_launcher()
    print("bound", flush=True)
    time.sleep(600)
""")
# Starts a worker in a session of its own, as torch's elastic agent does, and waits.
LAUNCHER = textwrap.dedent("""
    import subprocess, sys, time
    from automodel_ckpt.distributed.lifeline import mark_launcher
    mark_launcher()
    worker = subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True, stdout=subprocess.PIPE,
                              text=True)
    assert worker.stdout.readline().strip() == "bound"
    print(worker.pid, flush=True)
    time.sleep(600)
""")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "AUTOMODEL_CKPT_LAUNCHER_PID"}
    return dict(env, PYTHONPATH=str(REPO), TORCHELASTIC_RUN_ID="test", **extra)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _running(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_worker_dies_with_its_launcher_killed_by_sigkill():
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, WORKER], cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                                text=True)
    worker = int(launcher.stdout.readline())
    try:
        assert _running(worker)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        assert _gone_within(worker, TIMEOUT), "the worker outlived its launcher"
    finally:
        if _running(worker):
            os.kill(worker, signal.SIGKILL)


def test_a_worker_whose_launcher_died_before_it_bound_ends_at_once():
    dead = subprocess.Popen(["true"])
    dead.wait()
    proc = subprocess.run([sys.executable, "-c", WORKER], cwd=REPO, env=_env(AUTOMODEL_CKPT_LAUNCHER_PID=str(dead.pid)),
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == -signal.SIGKILL
    assert "bound" not in proc.stdout
    assert f"the launcher (pid {dead.pid}) is gone" in proc.stderr and len(proc.stderr.splitlines()) == 1


def test_the_watchdog_ends_a_worker_whose_launcher_is_not_its_parent():
    launcher = subprocess.Popen(["sleep", "600"])  # the launcher; the worker's parent (this process) lives on
    worker = subprocess.Popen([sys.executable, "-c", WORKER], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=_env(AUTOMODEL_CKPT_LAUNCHER_PID=str(launcher.pid)))
    try:
        assert worker.stdout.readline().strip() == "bound"
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        assert worker.wait(timeout=TIMEOUT) == -signal.SIGKILL
        assert "is gone; stopping" in worker.stderr.read()
    finally:
        for proc in (launcher, worker):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
