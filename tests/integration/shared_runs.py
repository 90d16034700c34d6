"""Straight runs that several test files compare against, trained once per test session and shared by its workers."""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

import pytest

from tests.integration.harness import ckpt_train

#: The straight runs' keys (the default recipe, a checkpoint every 4 steps, each step's sample ids logged, 64
#: held-out examples: each checkpoint validates, and the default 512 cost more than the steps) and steps
STRAIGHT_KEYS = ("--checkpoint.save_consolidated", "false", "--step_scheduler.ckpt_every_steps", "4",
                 "--training.log_sample_ids", "true", "--data.val_size", "64")
STRAIGHT_STEPS = 8


def session_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of this test session that every pytest-xdist worker of it sees (each worker has its own basetemp
    inside the session's)."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared_runs"
    folder.mkdir(exist_ok=True)
    return folder


class StraightRuns:
    """``get(nproc)``: the checkpoint_dir of the straight run on ``nproc`` processes, trained by the first worker
    that asks (under a file lock; the others wait for it) and renamed into place only once complete."""

    def __init__(self, folder: Path, assets: Path) -> None:
        self.folder, self.assets = folder, assets

    def get(self, nproc: int) -> Path:
        name = f"straight_{nproc}"
        done = self.folder / name
        with open(self.folder / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not done.is_dir():
                building = self.folder / f"building_{os.getpid()}"
                shutil.rmtree(building, ignore_errors=True)
                building.mkdir()
                ckpt_train(building, self.assets, *STRAIGHT_KEYS, "--step_scheduler.max_steps", str(STRAIGHT_STEPS),
                           "--checkpoint.checkpoint_dir", name, nproc=nproc)
                (building / name).rename(done)
                building.rmdir()
        return done
