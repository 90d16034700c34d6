"""One run per checkpoint folder: a second process is refused naming the holder; a killed holder never blocks, nor
do the processes it forked (they hold nothing, die with it, and are waited for a bounded time if still there)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from automodel_ckpt.ondisk import layout
from automodel_ckpt.checkpoint.storage.runlock import FolderInUseError, RunLock

REPO = Path(__file__).resolve().parents[4]
HOLD = textwrap.dedent("""
    import sys, time
    from automodel_ckpt.checkpoint.storage.runlock import RunLock
    RunLock(sys.argv[1]).acquire()
    print("held", flush=True)
    time.sleep(600)
""")


def _holder(folder: Path, launcher: int | None = None) -> subprocess.Popen:
    """Another process that takes ``folder`` and keeps it until killed; its launcher is this process (alive)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), AUTOMODEL_CKPT_LAUNCHER_PID=str(launcher or os.getpid()))
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env=env)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_process_is_refused_naming_the_holder_and_a_killed_holder_never_blocks(tmp_path):
    other = _holder(tmp_path)
    try:
        lock = RunLock(tmp_path)
        with pytest.raises(FolderInUseError) as err:
            lock.acquire()
        message = str(err.value)
        assert len(message.splitlines()) == 1 and str(tmp_path) in message
        assert f"host {socket.gethostname()}, pid {other.pid} (launcher pid {os.getpid()}), since " in message
        assert lock.holder() is not None and f"pid {other.pid}" in lock.holder()
        with pytest.raises(FolderInUseError):
            lock.refuse_if_held()
    finally:
        other.send_signal(signal.SIGKILL)
        other.wait()
    assert (tmp_path / layout.RUN_LOCK).exists()  # left by the killed holder, with its stale record
    assert lock.holder() is None
    lock.acquire()  # the kernel dropped the dead holder's lock
    assert f'"pid": {os.getpid()}' in (tmp_path / layout.RUN_LOCK).read_text()
    lock.release()
    assert not (tmp_path / layout.RUN_LOCK).exists()


def test_one_process_is_one_run_and_the_last_release_removes_the_file(tmp_path):
    first, second = RunLock(tmp_path), RunLock(tmp_path / ".." / tmp_path.name)
    first.acquire()
    second.acquire()  # the same process: the same run
    first.release()
    first.release()  # idempotent: counts once
    assert (tmp_path / layout.RUN_LOCK).exists()
    second.release()
    assert not (tmp_path / layout.RUN_LOCK).exists()


def test_a_released_folder_is_taken_by_the_next_process_at_once(tmp_path):
    lock = RunLock(tmp_path)
    lock.acquire()
    lock.release()
    other = _holder(tmp_path)  # would block forever in acquire's place if the lock had stayed
    try:
        with pytest.raises(FolderInUseError, match=f"pid {other.pid}"):
            RunLock(tmp_path).acquire()
    finally:
        other.send_signal(signal.SIGKILL)
        other.wait()


def test_a_holder_still_writing_its_record_is_described_as_starting(tmp_path):
    import fcntl

    fd = os.open(tmp_path / layout.RUN_LOCK, os.O_RDWR | os.O_CREAT)
    try:  # a lock taken through another open file conflicts even in this process (flock is per open file)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(FolderInUseError, match="holder not recorded yet"):
            RunLock(tmp_path).acquire()
    finally:
        os.close(fd)
    lock = RunLock(tmp_path)
    lock.acquire()
    lock.release()


def test_a_checkpointer_takes_its_folder_before_writing_and_gives_it_up_at_finalize(tmp_path):
    import torch

    from automodel_ckpt.checkpoint.checkpointer import Checkpointer
    from automodel_ckpt.checkpoint.config import CheckpointConfig
    from automodel_ckpt.distributed.env import DistEnv

    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    config = CheckpointConfig(checkpoint_dir=str(tmp_path / "run"), save_consolidated="false")
    other = _holder(tmp_path / "run")
    try:
        with pytest.raises(FolderInUseError, match=f"in use by another run .*pid {other.pid}"):
            Checkpointer(config, env, resolved_config_yaml="{}\n", say=lambda _: None)
    finally:
        other.send_signal(signal.SIGKILL)
        other.wait()
    ck = Checkpointer(config, env, resolved_config_yaml="{}\n", say=lambda _: None)
    assert ck._run.lock.held and f'"pid": {os.getpid()}' in (tmp_path / "run" / layout.RUN_LOCK).read_text()
    ck.finalize()
    assert not (tmp_path / "run" / layout.RUN_LOCK).exists()
    assert RunLock(tmp_path / "run").holder() is None


# --- what a killed run leaves behind ----------------------------------------------------------------------------
FORKS = textwrap.dedent("""
    import os, signal, sys
    from automodel_ckpt.checkpoint.storage.runlock import RunLock
    from automodel_ckpt.distributed.lifeline import children_die_with_this_process
    if sys.argv[2] == "bound":
        children_die_with_this_process()
    RunLock(sys.argv[1]).acquire()
    ready, started = os.pipe()
    child = os.fork()
    if child == 0:  # a DataLoader worker's way: forked, and left to run until something ends it
        os.write(started, b"1")  # the fork's hooks have run: only now may the test stop it
        while True:
            signal.pause()
    os.read(ready, 1)
    print(child, flush=True)
    sys.stdin.readline()
    os.kill(os.getpid(), 9)  # the holder is killed: only what it forked may still hold the lock
""")


def _forking_holder(folder: Path, bound: bool) -> tuple[subprocess.Popen, int]:
    """A process that takes ``folder``, forks a child that lives on, and is SIGKILLed when told (a line on stdin)."""
    proc = subprocess.Popen([sys.executable, "-c", FORKS, str(folder), "bound" if bound else "free"], cwd=REPO,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    return proc, int(proc.stdout.readline())


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_a_process_forked_by_the_holder_never_holds_the_lock(tmp_path):
    holder, child = _forking_holder(tmp_path, bound=False)
    try:
        assert RunLock(tmp_path).holder() is not None  # the holder has it
        holder.stdin.write("kill\n")
        holder.stdin.flush()
        holder.wait()
        assert _alive(child)  # its child lives on (nothing ends it here), yet holds nothing
        assert RunLock(tmp_path).holder() is None
        RunLock(tmp_path).acquire()  # at once: a third process takes the folder
    finally:
        os.kill(child, signal.SIGKILL)
        holder.kill()
        holder.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_process_forked_by_a_rank_dies_with_it(tmp_path):
    holder, child = _forking_holder(tmp_path, bound=True)
    os.kill(child, signal.SIGSTOP)  # stopped: it cannot end by itself; only a SIGKILL ends it
    holder.stdin.write("kill\n")
    holder.stdin.flush()
    holder.wait()
    deadline = time.monotonic() + 30
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.01)
    if _alive(child):
        os.kill(child, signal.SIGKILL)
        pytest.fail("the forked child outlived the process that forked it")


def test_a_killed_runs_leftover_holder_is_waited_for_in_one_line_then_the_folder_is_taken(tmp_path, capfd):
    import fcntl

    fd = os.open(tmp_path / layout.RUN_LOCK, os.O_RDWR | os.O_CREAT)
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()  # a pid that no longer runs: the killed run's rank 0
    record = {"host": socket.gethostname(), "pid": dead.pid, "since": 1.0, "launcher_pid": None}
    os.write(fd, json.dumps(record).encode() + b"\n")
    fcntl.flock(fd, fcntl.LOCK_EX)  # held by what the killed run left behind (here: another open file)
    # it ends while the next run waits: a thread stands for it, closing its descriptor once the wait is announced
    released = threading.Event()

    def leftover_ends() -> None:
        deadline = time.monotonic() + 60
        while "waiting for the workers of a killed run" not in capfd.readouterr().err and time.monotonic() < deadline:
            time.sleep(0.01)
        os.close(fd)
        released.set()

    thread = threading.Thread(target=leftover_ends)
    thread.start()
    lock = RunLock(tmp_path)
    try:
        lock.acquire()  # waits, then takes it
    finally:
        thread.join()
    assert released.is_set() and lock.held
    lock.release()


def test_a_killed_runs_leftover_holder_is_waited_for_a_bounded_time_and_a_live_one_not_at_all(tmp_path, monkeypatch,
                                                                                             capfd):
    from automodel_ckpt.checkpoint.storage import runlock

    monkeypatch.setattr(runlock, "KILLED_RUN_WAIT_SECONDS", 0.2)
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()
    # the launcher is dead, the recorded pid too: waited for, then refused (it never ended)
    other = _holder(tmp_path, launcher=dead.pid)
    try:
        for attempt in (RunLock(tmp_path).acquire, RunLock(tmp_path).refuse_if_held):
            with pytest.raises(FolderInUseError, match=r"in use by another run .* and still holds it after 0 s"):
                attempt()
            err = capfd.readouterr().err.strip().splitlines()
            assert err == [f"checkpoint.checkpoint_dir '{tmp_path}': waiting for the workers of a killed run "
                           f"(pid {other.pid}, launcher pid {dead.pid}) to exit (up to 0 s)"]
    finally:
        other.kill()
        other.wait()
    # a live holder with a live launcher: refused at once, nothing said
    monkeypatch.setattr(runlock, "KILLED_RUN_WAIT_SECONDS", 600)
    other = _holder(tmp_path)
    try:
        with pytest.raises(FolderInUseError) as refused:
            RunLock(tmp_path).acquire()
        assert "still holds it" not in str(refused.value)
        assert capfd.readouterr().err == ""
    finally:
        other.kill()
        other.wait()
