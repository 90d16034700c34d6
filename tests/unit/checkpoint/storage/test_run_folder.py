"""The run-folder seam: one kind of storage chosen once per config, and messages that name what was configured."""

from __future__ import annotations

import json

from automodel_ckpt.checkpoint import CheckpointConfig, storage
from automodel_ckpt.ondisk import layout
from automodel_ckpt.checkpoint.storage import LocalRunFolder, ObjectStoreRunFolder


def test_a_local_checkpoint_dir_names_its_paths(tmp_path):
    run = storage.open_run_folder(CheckpointConfig(checkpoint_dir=str(tmp_path / "run")), 0, 1)
    assert type(run) is LocalRunFolder and run.local == tmp_path / "run" and run.reserves_in_background
    assert run.location("epoch_0_step_4") == str(tmp_path / "run" / "epoch_0_step_4")
    assert run.location_of(tmp_path / "run" / "epoch_0_step_4") == str(tmp_path / "run" / "epoch_0_step_4")


def test_an_object_store_checkpoint_names_its_url_not_the_mirror(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cfg = CheckpointConfig(checkpoint_dir="s3://bucket/run", staging_dir=str(tmp_path / "mirror"))
    run = storage.open_run_folder(cfg, 0, 1)
    assert type(run) is ObjectStoreRunFolder and run.local == tmp_path / "mirror"
    assert not run.reserves_in_background  # the store is checked before the staging folder is made
    assert run.location("epoch_0_step_4") == "s3://bucket/run/epoch_0_step_4"
    # a checkpoint of the mirror (what resume loads) is named by the URL its mirror copies ("Loading checkpoint
    # from s3://bucket/run/epoch_0_step_4"), as the pull records it
    (tmp_path / "mirror" / "epoch_0_step_4").mkdir(parents=True)
    (tmp_path / "mirror" / layout.OBJECT_STORE_SOURCE).write_text(json.dumps({"url": "s3://bucket/run"}) + "\n")
    assert run.location_of(tmp_path / "mirror" / "epoch_0_step_4") == "s3://bucket/run/epoch_0_step_4"
    # so is a restore_from URL's checkpoint in a local run's read mirror
    local = storage.open_run_folder(CheckpointConfig(checkpoint_dir=str(tmp_path / "run")), 0, 1)
    assert local.location_of(tmp_path / "mirror" / "epoch_0_step_4") == "s3://bucket/run/epoch_0_step_4"
