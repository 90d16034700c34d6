"""The storage contract: every kind of run folder keeps the interface's promises (``storage.base.RunStorage``).

Each test runs once per kind: a local folder, an object store (a real S3 server, SeaweedFS) through its mirror, and
a node's folder of the node-local tier (one node here: ``tests/integration/test_fast_recovery.py`` has two).
A new kind of storage is added to ``KINDS`` and must pass every test here unchanged.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from automodel_ckpt.checkpoint import CheckpointConfig, storage
from automodel_ckpt.ondisk import catalog, layout, manifest
from automodel_ckpt.ondisk.metadata import build_metadata, read_metadata, write_metadata
from automodel_ckpt.ondisk.durable import read_pointer
from automodel_ckpt.ondisk.retention import RetentionPolicy
from automodel_ckpt.checkpoint.storage.nodelocal.folder import NodeLocalRunFolder
from automodel_ckpt.checkpoint.storage.nodelocal.placement import place

KINDS = ["local", "object_store", "nodelocal"]


class Kind:
    """One kind of run folder under test: how to open it, and how a fresh reader (another process) sees it."""

    def __init__(self, name: str, tmp_path: Path, seaweed=None) -> None:
        self.name, self.tmp_path, self.seaweed = name, tmp_path, seaweed
        if name in ("local", "nodelocal"):
            self.location = str(tmp_path / "run")
        else:
            self.location = f"s3://{seaweed.new_bucket()}/run"

    def config(self, **retention) -> CheckpointConfig:
        return CheckpointConfig(checkpoint_dir=self.location, staging_dir=str(self.tmp_path / "mirror"), **retention)

    def open(self, **retention):
        if self.name == "nodelocal":
            run = NodeLocalRunFolder(Path(self.location), place(0, 1, 1, 0), run_id="contract", fingerprint=None,
                                     monitor=storage.monitor_of(self.config(**retention)), default_folder=False,
                                     say=lambda _: None)
        else:
            run = storage.open_run_folder(self.config(**retention), 0, 1)
        run.acquire()
        return run

    def committed(self) -> list[str]:
        """The checkpoints a new reader lists (for a store: what its objects say, not this process's mirror)."""
        folder = storage.open_for_reading(self.location)
        return [r.name for r in catalog.scan_checkpoints(folder)]

    def pointer(self, name: str) -> str | None:
        folder = storage.open_for_reading(self.location)
        return read_pointer(folder, name)

    def plant_foreign(self) -> None:
        """Files another program keeps in the run folder."""
        if self.name != "object_store":
            (Path(self.location) / "notes").mkdir(parents=True)
            (Path(self.location) / "notes" / "todo.txt").write_text("mine\n")
            (Path(self.location) / "README.txt").write_text("mine\n")
        else:
            fs = self.seaweed.filesystem()
            root = self.location.removeprefix("s3://")
            fs.pipe({f"{root}/notes/todo.txt": b"mine\n", f"{root}/README.txt": b"mine\n"})

    def foreign_intact(self) -> bool:
        if self.name != "object_store":
            return ((Path(self.location) / "notes" / "todo.txt").read_text() == "mine\n"
                    and (Path(self.location) / "README.txt").read_text() == "mine\n")
        fs = self.seaweed.filesystem()
        root = self.location.removeprefix("s3://")
        return fs.cat(f"{root}/notes/todo.txt") == b"mine\n" and fs.cat(f"{root}/README.txt") == b"mine\n"


@pytest.fixture(params=KINDS)
def kind(request, tmp_path, monkeypatch, process_group):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    if request.param == "local":
        yield Kind("local", tmp_path)
        return
    seaweed = request.getfixturevalue("seaweed")
    for key, value in seaweed.env().items():
        monkeypatch.setenv(key, value)
    yield Kind("object_store", tmp_path, seaweed)


def stage(run, name: str, step: int, val_loss: float | None = None) -> Path:
    """Reserve and write a small, sealed checkpoint ``name``; not committed yet."""
    staging = run.reserve(name)
    assert staging == run.staging(name)
    (staging / "model").mkdir()
    (staging / "model" / "weights.bin").write_bytes(bytes([step]) * 64)
    write_metadata(staging, build_metadata(name=name, epoch=0, step=step, train_loss=1.0, val_loss=val_loss,
                                           is_final=False, world_size=1, model_save_format="safetensors"))
    manifest.seal(staging, 0, 1)
    run.upload(staging, name)
    return staging


def save(run, step: int, val_loss: float | None = None) -> Path:
    name = f"epoch_0_step_{step}"
    staging = stage(run, name, step, val_loss)
    best = run.best()
    return run.commit(staging, name, best=run.monitor.beats(read_metadata(staging), read_metadata(best) if best else None))


def test_a_checkpoint_is_visible_only_once_committed(kind):
    run = kind.open()
    staging = stage(run, "epoch_0_step_1", 1)
    assert kind.committed() == [] and run.find(None) is None and not run.has_checkpoints()
    path = run.commit(staging, "epoch_0_step_1", best=False)
    assert path == run.local / "epoch_0_step_1" and not staging.exists()
    assert kind.committed() == ["epoch_0_step_1"] and kind.pointer(layout.LATEST) == "epoch_0_step_1"
    assert run.find(None) == path and run.has_checkpoints()
    assert run.location("epoch_0_step_1").startswith(kind.location)
    run.release()


def test_an_existing_checkpoint_is_never_overwritten(kind):
    run = kind.open()
    save(run, 1)
    with pytest.raises(Exception, match="already exists|never overwritten"):
        run.reserve("epoch_0_step_1")
    assert kind.committed() == ["epoch_0_step_1"]
    run.release()


def test_best_follows_the_monitor_and_the_commit_sets_lowest_val(kind):
    run = kind.open()
    save(run, 1, val_loss=2.0)
    save(run, 2, val_loss=1.0)
    save(run, 3, val_loss=3.0)
    assert run.best() == run.local / "epoch_0_step_2"
    assert kind.pointer(layout.LOWEST_VAL) == "epoch_0_step_2" and kind.pointer(layout.LATEST) == "epoch_0_step_3"
    run.release()


def test_pointers_follow_a_quarantine(kind):
    run = kind.open()
    save(run, 1, val_loss=2.0)
    save(run, 2, val_loss=1.0)
    where = run.quarantine("epoch_0_step_2", "damaged for the test")
    assert "quarantine" in where
    assert kind.committed() == ["epoch_0_step_1"]
    assert kind.pointer(layout.LATEST) == "epoch_0_step_1" and kind.pointer(layout.LOWEST_VAL) == "epoch_0_step_1"
    assert run.find(None) == run.local / "epoch_0_step_1"
    run.release()


def test_prune_keeps_what_the_policy_keeps_and_nothing_foreign_is_deleted(kind):
    cfg = dict(max_recent_checkpoints=2, keep_steps=[1])
    run = kind.open(**cfg)
    kind.plant_foreign()
    policy = RetentionPolicy.from_config(kind.config(**cfg))
    for step in (1, 2, 3, 4):
        save(run, step, val_loss=10.0 - step)
        run.prune(policy, None)
    # kept: the two most recent (the newer one is also LOWEST_VAL's target) and the milestone step 1
    assert kind.committed() == ["epoch_0_step_1", "epoch_0_step_3", "epoch_0_step_4"]
    assert kind.foreign_intact()
    run.release()


def test_a_pruned_checkpoint_is_gone_for_every_reader(kind):
    cfg = dict(max_recent_checkpoints=1)
    run = kind.open(**cfg)
    policy = RetentionPolicy.from_config(kind.config(**cfg))
    save(run, 1)
    save(run, 2)
    assert run.prune(policy, None) == ["epoch_0_step_1"]
    assert kind.committed() == ["epoch_0_step_2"] and not (run.local / "epoch_0_step_1").exists()
    run.release()
