"""Scanning a checkpoint_dir (metadata first, default names as fallback), restore selection, and `inspect`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from automodel_ckpt import cli
from automodel_ckpt.ondisk import CheckpointFolder, catalog, layout
from automodel_ckpt.cli.inspect import human_size, inspect_dir, render_table
from automodel_ckpt.ondisk.metadata import as_float, build_metadata, metric_value, read_metadata, write_metadata
from automodel_ckpt.ondisk.durable import set_pointer
from automodel_ckpt.errors import UserError


def make(root: Path, name: str, step: int | None, *, val: float | None = None, epoch: int = 0,
         meta: bool = True, consolidated: bool = False, fmt: str = "safetensors", size: int = 100) -> Path:
    folder = root / name
    (folder / "model").mkdir(parents=True)
    shard = layout.model_shard_file(0, 1, 1) if fmt == "safetensors" else layout.dcp_rank_file(0)
    (folder / "model" / shard).write_bytes(b"\0" * size)
    if fmt == "torch_save":
        (folder / "model" / layout.DCP_METADATA).write_bytes(b"")
    if consolidated:
        CheckpointFolder(folder).model.consolidated.path.mkdir(parents=True)
        (CheckpointFolder(folder).model.consolidated / layout.hf_weights_file(1, 1)).write_bytes(b"\0" * size)
    if meta:
        write_metadata(folder, build_metadata(
            name=name, epoch=epoch, step=step, train_loss=2.0, val_loss=val, is_final=False,
            extra={"consumed_samples": (step or 0) * 64}, world_size=2, model_save_format=fmt,
            training_seconds=1.5,
        ))
    return folder


# --- metadata ------------------------------------------------------------------------------------------------


def test_metadata_fields_round_trip_and_non_finite_values(tmp_path):
    make(tmp_path, "a", 3, val=float("inf"))
    meta = read_metadata(tmp_path / "a")
    assert {"step", "epoch", "consumed_samples", "train_loss", "val_loss", "val_metrics", "saved_at",
            "training_seconds", "world_size", "model_save_format", "automodel_ckpt_version", "torch_version",
            "layout_version", "is_final", "name", "mesh"} <= set(meta)
    assert meta["val_loss"] == "inf" and as_float(meta["val_loss"]) == math.inf
    assert meta["layout_version"] == layout.LAYOUT_VERSION == 1
    assert metric_value(meta, "val_loss") == math.inf
    assert metric_value(meta, "accuracy") is None
    assert metric_value(meta, "val_loss", "squad") is None
    assert metric_value({"val_metrics": {"squad": {"acc": 0.5}}}, "acc", "squad") == 0.5
    raw = (tmp_path / "a" / layout.METADATA_FILE).read_text()
    json.loads(raw, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"step": "3"}', '{"epoch": 1}', '{"step": true}'])
def test_unusable_metadata_reads_as_none(tmp_path, content):
    (tmp_path / layout.METADATA_FILE).write_text(content)
    assert read_metadata(tmp_path) is None


# --- scanning and restore selection ----------------------------------------------------------------------------


def test_scan_identifies_checkpoints_by_metadata_then_default_names(tmp_path):
    make(tmp_path, "ck_10", 10)
    make(tmp_path, "ck_9", 9)
    make(tmp_path, "epoch_0_step_2", None, meta=False)  # written without metadata: the name says step 2
    make(tmp_path, "epoch_0_step_99", 5)  # the metadata wins over the name
    make(tmp_path, "notes", None, meta=False)  # not a checkpoint
    make(tmp_path, ".staging-ck_11", 11)
    make(tmp_path, ".staging-epoch_0_step_12", None, meta=False)
    make(tmp_path, ".staging-whatever", None, meta=False)
    make(tmp_path, layout.deleting_name("ck_1"), 1)
    (tmp_path / "epoch_0_step_3").write_text("a file, not a folder")
    set_pointer(tmp_path, layout.LATEST, "ck_10")
    assert [(r.name, r.step) for r in catalog.scan_checkpoints(tmp_path)] == [
        ("epoch_0_step_2", 2), ("epoch_0_step_99", 5), ("ck_9", 9), ("ck_10", 10)]
    incomplete = [(r.name, r.step) for r in catalog.scan_checkpoints(tmp_path, include_incomplete=True)
                  if not r.complete]
    assert incomplete == [(".staging-ck_11", 11), (".staging-epoch_0_step_12", 12), (".staging-whatever", None)]
    assert [r.step for r in catalog.scan_checkpoints(tmp_path)] == [2, 5, 9, 10]
    assert catalog.scan_checkpoints(tmp_path / "missing") == []


def test_latest_falls_back_to_the_newest_by_metadata_step_with_any_template(tmp_path):
    make(tmp_path, "run-9-x", 9)
    make(tmp_path, "run-10-x", 10)
    assert catalog.latest_checkpoint(tmp_path) == tmp_path / "run-10-x"  # no LATEST: newest by step, not by name
    set_pointer(tmp_path, layout.LATEST, "run-9-x")  # LATEST behind (a run died between publish and the swap)
    assert catalog.latest_checkpoint(tmp_path) == tmp_path / "run-10-x"
    set_pointer(tmp_path, layout.LATEST, "run-10-x")
    assert catalog.resolve_restore_from(tmp_path, None) == tmp_path / "run-10-x"
    assert catalog.resolve_restore_from(tmp_path, "run-9-x") == tmp_path / "run-9-x"


# --- inspect -----------------------------------------------------------------------------------------------------


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    make(tmp_path, "epoch_0_step_2", 2, val=3.5, size=1000)
    make(tmp_path, "epoch_0_step_4", 4, val=float("nan"), fmt="torch_save", size=2000)
    make(tmp_path, "epoch_1_step_6", 6, val=2.25, epoch=1, consolidated=True, size=3000)
    make(tmp_path, ".staging-epoch_1_step_8", None, meta=False)
    set_pointer(tmp_path, layout.LATEST, "epoch_1_step_6")
    set_pointer(tmp_path, layout.LOWEST_VAL, "epoch_1_step_6")
    (tmp_path / layout.TRAINING_LOG).write_text("{}\n")
    return tmp_path


def test_inspect_report_matches_the_disk(run_dir):
    report = inspect_dir(run_dir)
    rows = {r["name"]: r for r in report["checkpoints"]}
    assert list(rows) == ["epoch_0_step_2", "epoch_0_step_4", "epoch_1_step_6", ".staging-epoch_1_step_8"]
    assert [r["step"] for r in rows.values()] == [2, 4, 6, 8]
    assert rows["epoch_1_step_6"]["pointers"] == ["LATEST", "LOWEST_VAL"]
    assert rows["epoch_1_step_6"]["consolidated"] is True and rows["epoch_1_step_6"]["epoch"] == 1
    assert rows["epoch_0_step_4"]["format"] == "torch_save" and rows["epoch_0_step_4"]["val_loss"] is None
    assert rows["epoch_0_step_2"]["val_loss"] == 3.5 and rows["epoch_0_step_2"]["consumed_samples"] == 128
    assert rows[".staging-epoch_1_step_8"]["complete"] is False and rows[".staging-epoch_1_step_8"]["format"] == "safetensors"
    assert rows["epoch_0_step_2"]["mesh"] == "dp 2"  # the mesh that wrote it (2 ranks, one dimension)
    for name, row in rows.items():
        assert row["size_bytes"] == sum(p.stat().st_size for p in (run_dir / name).rglob("*") if p.is_file())
    assert report["totals"] == {"count": 4, "complete": 3, "size_bytes": sum(r["size_bytes"] for r in rows.values())}
    assert report["pointers"]["LATEST"] == {"target": "epoch_1_step_6", "exists": True}


def test_inspect_table_and_json_through_the_cli(run_dir, capsys):
    assert cli.main(["inspect", str(run_dir)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["NAME", "STEP", "EPOCH", "VAL_LOSS", "SIZE", "FAMILY", "FORMAT", "MESH", "CONSOLIDATED",
                                "COMPLETE", "POINTERS"]
    assert table[3].split()[:4] == ["epoch_1_step_6", "6", "1", "2.2500"]
    assert table[3].endswith("LATEST, LOWEST_VAL")
    assert table[4].split()[0] == ".staging-epoch_1_step_8" and " no " in table[4]
    assert table[5].startswith("4 checkpoints (3 complete), ")
    assert cli.main(["inspect", str(run_dir), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(inspect_dir(run_dir)))


def test_lineage_of_a_run_folder_is_its_latest_checkpoints(run_dir, capsys):
    """``inspect RUN --lineage``: the chain of the checkpoint LATEST names, said so; a checkpoint's own as before."""
    meta = json.loads((run_dir / "epoch_1_step_6" / layout.METADATA_FILE).read_text())
    meta["lineage"] = {"parents": [{"role": "base model", "path": "/models/base", "fingerprint": "sha256:ab"}]}
    (run_dir / "epoch_1_step_6" / layout.METADATA_FILE).write_text(json.dumps(meta))
    assert cli.main(["inspect", str(run_dir), "--lineage"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"'{run_dir}' is a run folder: the lineage of its LATEST, epoch_1_step_6"
    assert lines[1].startswith(f"lineage of '{run_dir / 'epoch_1_step_6'}' (sha256:")
    assert lines[2:] == ["  base model: /models/base (sha256:ab) [gone]"]
    assert cli.main(["inspect", str(run_dir / "epoch_0_step_2"), "--lineage"]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == ["  no lineage recorded (written before lineage was, or not by "
                                                        "ckpt-train)"]


def test_inspect_one_checkpoint_and_dangling_pointers(run_dir):
    (run_dir / "epoch_1_step_6").rename(run_dir / "moved")
    report = inspect_dir(run_dir / "epoch_0_step_2")
    assert [r["name"] for r in report["checkpoints"]] == ["epoch_0_step_2"]
    text = render_table(inspect_dir(run_dir))
    assert "LATEST -> epoch_1_step_6 (missing)" in text and "LOWEST_VAL -> epoch_1_step_6 (missing)" in text


def test_inspect_errors_are_one_line(tmp_path, capsys):
    assert cli.main(["inspect", str(tmp_path / "nope")]) == UserError.exit_code
    err = capsys.readouterr().err.strip()
    assert err == f"error: checkpoint folder '{tmp_path / 'nope'}' not found"
    assert cli.main(["inspect"]) == UserError.exit_code
    assert capsys.readouterr().err.strip().count("\n") == 0


def test_inspect_empty_dir(tmp_path):
    text = render_table(inspect_dir(tmp_path))
    assert "0 checkpoints (0 complete), 0 B in total" in text and "LATEST: not set" in text


@pytest.mark.parametrize("size, text", [(0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (5 * 2**30, "5.0 GiB"),
                                        (3 * 2**40, "3.0 TiB")])
def test_human_size(size, text):
    assert human_size(size) == text
