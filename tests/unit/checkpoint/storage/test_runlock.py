"""One run per checkpoint folder: a second process is refused naming the holder; a killed holder never blocks."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
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


def _holder(folder: Path) -> subprocess.Popen:
    """Another process that takes ``folder`` and keeps it until killed."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(REPO), AUTOMODEL_CKPT_LAUNCHER_PID="4242"))
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
        assert f"host {socket.gethostname()}, pid {other.pid} (launcher pid 4242), since " in message
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
    assert ck.lock.held and f'"pid": {os.getpid()}' in (tmp_path / "run" / layout.RUN_LOCK).read_text()
    ck.finalize()
    assert not (tmp_path / "run" / layout.RUN_LOCK).exists()
    assert RunLock(tmp_path / "run").holder() is None
