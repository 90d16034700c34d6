"""Resume's pre-load check and quarantine: damaged checkpoints are found before loading and moved aside."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from automodel_ckpt.ondisk import catalog, layout
from automodel_ckpt.ondisk.quarantine import quarantine
from automodel_ckpt.checkpoint.restore.probe import probe
from automodel_ckpt.ondisk.durable import read_pointer, set_pointer
from automodel_ckpt.cli.inspect import inspect_dir, render_table
from automodel_ckpt.errors import CheckpointError
from tests.unit.ondisk.test_catalog_inspect import make


def _loadable(root: Path, name: str, step: int, val: float | None = None) -> Path:
    folder = make(root, name, step, val=val)
    save_file({"w": torch.ones(4)}, str(folder / "model" / layout.model_shard_file(0, 1, 1)))
    torch.save({"step": step}, folder / layout.global_state_file("step_scheduler"))
    (folder / "rng").mkdir()
    torch.save({"x": 1}, folder / layout.rank_state_file("rng", 0))
    return folder


def _probe(folder: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no manifest in these hand-made folders
        probe(folder, checksums=False, rank=0, world_size=1)


def test_probe_passes_a_loadable_checkpoint(tmp_path):
    _probe(_loadable(tmp_path, "epoch_0_step_2", 2))


@pytest.mark.parametrize("damage", ["header", "pt", "rank_pt"])
def test_probe_names_the_damaged_file(tmp_path, damage):
    folder = _loadable(tmp_path, "epoch_0_step_2", 2)
    target = {"header": folder / "model" / layout.model_shard_file(0, 1, 1),
              "pt": folder / layout.global_state_file("step_scheduler"),
              "rank_pt": folder / layout.rank_state_file("rng", 0)}[damage]
    data = bytearray(target.read_bytes())
    data[8:12] = b"\xff\xff\xff\xff" if damage == "header" else b"\x00\x00\x00\x00"
    target.write_bytes(bytes(data[: len(data) // 2]) if damage != "header" else bytes(data))
    with pytest.raises(CheckpointError, match=target.name):
        _probe(folder)


def test_quarantine_moves_aside_and_repoints(tmp_path):
    _loadable(tmp_path, "epoch_0_step_2", 2, val=1.0)
    _loadable(tmp_path, "epoch_0_step_4", 4, val=3.0)
    _loadable(tmp_path, "epoch_0_step_6", 6, val=0.5)
    set_pointer(tmp_path, layout.LATEST, "epoch_0_step_6")
    set_pointer(tmp_path, layout.LOWEST_VAL, "epoch_0_step_6")
    moved = quarantine(tmp_path, "epoch_0_step_6", "checkpoint is damaged: 1 missing file")
    assert moved == tmp_path / layout.QUARANTINE_DIR / "epoch_0_step_6" and moved.is_dir()
    assert [r.name for r in catalog.scan_checkpoints(tmp_path)] == ["epoch_0_step_2", "epoch_0_step_4"]
    assert read_pointer(tmp_path, layout.LATEST) == "epoch_0_step_4"
    assert read_pointer(tmp_path, layout.LOWEST_VAL) == "epoch_0_step_2"  # the best left by val_loss
    [q] = catalog.quarantined_checkpoints(tmp_path)
    assert q["name"] == "epoch_0_step_6" and q["step"] == 6 and "1 missing file" in q["reason"]
    report = inspect_dir(tmp_path)
    assert [r["name"] for r in report["checkpoints"]] == ["epoch_0_step_2", "epoch_0_step_4"]
    assert "quarantined" in render_table(report) and "1 missing file" in render_table(report)


def test_quarantine_of_the_last_checkpoint_removes_the_pointers(tmp_path):
    _loadable(tmp_path, "epoch_0_step_2", 2, val=1.0)
    set_pointer(tmp_path, layout.LATEST, "epoch_0_step_2")
    set_pointer(tmp_path, layout.LOWEST_VAL, "epoch_0_step_2")
    quarantine(tmp_path, "epoch_0_step_2", "damaged")
    assert read_pointer(tmp_path, layout.LATEST) is None and read_pointer(tmp_path, layout.LOWEST_VAL) is None
    assert not os.path.lexists(tmp_path / layout.LATEST)
    assert catalog.latest_checkpoint(tmp_path) is None


def test_the_same_name_quarantined_twice_keeps_both(tmp_path):
    for _ in range(2):
        _loadable(tmp_path, "epoch_0_step_2", 2)
        quarantine(tmp_path, "epoch_0_step_2", "damaged")
    assert sorted(q["name"] for q in catalog.quarantined_checkpoints(tmp_path)) == ["epoch_0_step_2",
                                                                           "epoch_0_step_2.2"]
