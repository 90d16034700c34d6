"""Retention, LOWEST_VAL and `ckpt-train inspect` on a real 2-process run that is stopped at step 4 and resumed to 8."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.harness import CKPT_TRAIN, ckpt_train, env_for, jsonl, run_command

pytestmark = pytest.mark.integration

RETENTION = ("--checkpoint.max_recent_checkpoints", "2", "--checkpoint.save_top_k", "1",
             "--checkpoint.keep_steps", "[4]")
COMMON = ("--step_scheduler.ckpt_every_steps", "2", "--step_scheduler.val_every_steps", "2", "--data.val_size", "64",
          "--checkpoint.checkpoint_dir", "ck", *RETENTION)


def pointer(run_dir: Path, name: str) -> str:
    link = run_dir / name
    assert link.is_symlink() and (run_dir / link.readlink()).is_dir(), f"{name} must target a checkpoint"
    return str(link.readlink())


def replay_retention(vals: dict[int, float], max_recent: int = 2, keep_steps: frozenset = frozenset({4})) -> set[int]:
    """The steps that survive when every save prunes with max_recent=2, save_top_k=1 (min), keep_steps=[4]."""
    kept: list[int] = []
    lowest = None
    for step in sorted(vals):
        kept.append(step)
        lowest = step if lowest is None or vals[step] < vals[lowest] else lowest  # LOWEST_VAL (strictly better)
        top1 = min(kept, key=lambda s: (vals[s], s))
        kept = [s for s in kept if s in {step, lowest, top1, *kept[-max_recent:], *keep_steps}]
    return set(kept)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, assets: Path) -> dict:
    work = tmp_path_factory.mktemp("retention")
    first = ckpt_train(work, assets, *COMMON, "--step_scheduler.max_steps", "4",
                       "--checkpoint.save_consolidated", "false", nproc=2)
    ck = work / "ck"
    after_first = {
        "dirs": sorted(p.name for p in ck.iterdir() if p.is_dir() and not p.is_symlink()),
        "LATEST": pointer(ck, "LATEST"),
        "LOWEST_VAL": pointer(ck, "LOWEST_VAL"),
        "vals": {r["step"]: r["val_loss"] for r in jsonl(ck / "validation.jsonl")},
    }
    second = ckpt_train(work, assets, *COMMON, "--step_scheduler.max_steps", "8",
                        "--checkpoint.save_consolidated", "final", nproc=2)
    return {"work": work, "ck": ck, "first": after_first, "output": first.output + second.output, "assets": assets}


def test_retention_keeps_exactly_the_union_and_lowest_val_survives_the_restart(run):
    ck, first = run["ck"], run["first"]
    # First run (steps 2, 4): nothing to prune yet, pointers valid.
    assert first["dirs"] == ["epoch_0_step_2", "epoch_0_step_4"]
    assert first["LATEST"] == "epoch_0_step_4"
    assert first["LOWEST_VAL"] == f"epoch_0_step_{min(first['vals'], key=first['vals'].get)}"
    # After the resumed run to step 8.
    vals = {r["step"]: r["val_loss"] for r in jsonl(ck / "validation.jsonl")}
    assert sorted(vals) == [2, 4, 6, 8]
    assert {s: vals[s] for s in (2, 4)} == first["vals"]  # the resumed run kept the first run's records
    expected = replay_retention(vals)
    survivors = sorted(p.name for p in ck.iterdir() if p.is_dir() and not p.is_symlink())
    assert survivors == sorted(f"epoch_0_step_{s}" for s in expected)
    assert not [p.name for p in ck.iterdir() if p.name.startswith(".")]  # no staging or half-deleted folders
    assert pointer(ck, "LATEST") == "epoch_0_step_8"
    assert pointer(ck, "LOWEST_VAL") == f"epoch_0_step_{min(vals, key=vals.get)}"
    for step in {2, 4, 6, 8} - expected:
        assert f"Removed checkpoints by retention: epoch_0_step_{step}" in run["output"]
    for step in expected:
        meta = json.loads((ck / f"epoch_0_step_{step}" / "metadata.json").read_text())
        assert (meta["step"], meta["epoch"], meta["consumed_samples"]) == (step, 0, step * 64)
        assert meta["val_loss"] == vals[step] and meta["world_size"] == 2 and meta["layout_version"] == 1
        assert meta["model_save_format"] == "safetensors" and meta["is_final"] == (step in (4, 8))  # the first run ended at 4


def _inspect(run: dict, *args: str) -> str:
    proc = run_command([CKPT_TRAIN, "inspect", "ck", *args], cwd=run["work"], env=env_for(run["assets"]), timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_inspect_matches_the_disk(run):
    ck = run["ck"]
    on_disk = sorted((p for p in ck.iterdir() if p.is_dir() and not p.is_symlink()),
                     key=lambda p: json.loads((p / "metadata.json").read_text())["step"])
    report = json.loads(_inspect(run, "--json"))
    assert [r["name"] for r in report["checkpoints"]] == [p.name for p in on_disk]
    assert [r["step"] for r in report["checkpoints"]] == [int(p.name.rsplit("_", 1)[1]) for p in on_disk]
    assert all(r["complete"] and r["format"] == "safetensors" for r in report["checkpoints"])
    assert [r["consolidated"] for r in report["checkpoints"]] == [p.name == "epoch_0_step_8" for p in on_disk]
    pointers = {name: str((ck / name).readlink()) for name in ("LATEST", "LOWEST_VAL")}
    # no score is monitored: BEST_EVAL is listed, unset
    assert {k: v["target"] for k, v in report["pointers"].items()} == pointers | {"BEST_EVAL": None}
    for row in report["checkpoints"]:
        assert row["pointers"] == [k for k, v in pointers.items() if v == row["name"]]
        assert row["size_bytes"] == sum(f.stat().st_size for f in (ck / row["name"]).rglob("*") if f.is_file())
    assert report["totals"]["count"] == len(on_disk)

    table = _inspect(run).splitlines()
    assert [line.split()[0] for line in table[1:-1]] == [p.name for p in on_disk]
    assert table[-1].startswith(f"{len(on_disk)} checkpoints ({len(on_disk)} complete)")
    latest_row = next(line for line in table if line.startswith("epoch_0_step_8"))
    assert "LATEST" in latest_row
    assert "LOWEST_VAL" in next(line for line in table if line.startswith(pointers["LOWEST_VAL"]))
