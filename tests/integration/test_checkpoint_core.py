"""Checkpoint core, end to end: the layout file for file, exact resume, custom state, crash during a save."""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

import pytest
import torch

from tests.integration.harness import REPO, ckpt_train, jsonl, losses, tree

FORMATS = ("safetensors", "torch_save")
COMMON = ("--step_scheduler.ckpt_every_steps", "4", "--checkpoint.save_consolidated", "false", "--data.val_size", "64")


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("core")


@cache
def _resumed(work: Path, assets: Path, nproc: int, fmt: str) -> tuple[Path, str]:
    run_dir = f"resumed_{nproc}_{fmt}"
    args = (*COMMON, "--checkpoint.model_save_format", fmt, "--checkpoint.checkpoint_dir", run_dir)
    ckpt_train(work, assets, *args, "--step_scheduler.max_steps", "4", nproc=nproc)
    second = ckpt_train(work, assets, *args, "--step_scheduler.max_steps", "8", nproc=nproc)
    return work / run_dir, second.output


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("nproc", [1, 2])
def test_resume_is_bitwise_exact(work, assets, straight_runs, nproc, fmt):
    straight = straight_runs.get(nproc)
    resumed, output = _resumed(work, assets, nproc, fmt)
    assert f"Loading checkpoint from {resumed.name}/epoch_0_step_4" in output
    assert len(losses(straight)) == 8
    assert losses(resumed) == losses(straight)  # bitwise: same floats, not approximately
    assert [r["val_loss"] for r in jsonl(resumed / "validation.jsonl")] == \
           [r["val_loss"] for r in jsonl(straight / "validation.jsonl")]


def test_resume_with_activation_checkpointing_is_bitwise_exact_and_matches_a_run_without_it(
        work, assets, straight_runs):
    """Two processes, stopped after the checkpoint of step 4 and resumed to step 8.

    On the CPU the recomputed blocks give the very floats of a run that kept its activations (the unit test shows
    it for losses and gradients), so the straight run without it stands for the straight run with it.
    The format does not matter to it: the parameter names are unchanged (unit test).
    """
    ac = (*COMMON, "--distributed.activation_checkpointing", "true", "--checkpoint.checkpoint_dir", "ac")
    first = ckpt_train(work, assets, *ac, "--step_scheduler.max_steps", "4", nproc=2)
    second = ckpt_train(work, assets, *ac, "--step_scheduler.max_steps", "8", nproc=2)
    for result in (first, second):
        assert "Activation checkpointing: 4 blocks recompute their activations in backward" in result.stdout
    assert "Loading checkpoint from ac/epoch_0_step_4" in second.output
    assert len(losses(work / "ac")) == 8
    assert losses(work / "ac") == losses(straight_runs.get(2))  # bitwise: same floats


def _expected_checkpoint_files(fmt: str, world: int) -> set[str]:
    files = {"config.yaml", "losses.json", "step_scheduler.pt", "lr_scheduler.pt", "optim/.metadata",
             "metadata.json", "manifest.json"}
    for r in range(world):
        files |= {f"optim/__{r}_0.distcp", f"dataloader/dataloader_dp_rank_{r}.pt", f"rng/rng_dp_rank_{r}.pt"}
        if fmt == "safetensors":
            files.add(f"model/shard-{r + 1:05d}-model-00001-of-00001.safetensors")
        else:
            files.add(f"model/__{r}_0.distcp")
    files.add("model/consolidate.sh" if fmt == "safetensors" else "model/.metadata")
    return files


def _visible(paths: set[str]) -> set[str]:
    """Drop hidden helper folders (e.g. model/.hf_metadata/) but keep DCP's .metadata files."""
    return {p for p in paths if not any(part.startswith(".") and part != ".metadata" for part in p.split("/"))}


@pytest.mark.parametrize("fmt", FORMATS)
def test_layout_file_for_file(work, assets, fmt):
    run_dir, output = _resumed(work, assets, 2, fmt)
    expected = {"LATEST", "LOWEST_VAL", "training.jsonl", "validation.jsonl", "events.jsonl"}
    for name in ("epoch_0_step_4", "epoch_0_step_8"):
        expected |= {f"{name}/{f}" for f in _expected_checkpoint_files(fmt, 2)}
    assert _visible(tree(run_dir)) == expected
    assert os.readlink(run_dir / "LATEST") == "epoch_0_step_8"  # relative link
    assert (run_dir / "LOWEST_VAL").resolve().parent == run_dir.resolve()
    assert "Saving checkpoint to" in output
    if fmt == "safetensors":
        assert os.access(run_dir / "epoch_0_step_8" / "model" / "consolidate.sh", os.X_OK)


@pytest.mark.parametrize("fmt", FORMATS)
def test_config_yaml_records_overrides(work, assets, fmt):
    run_dir, _ = _resumed(work, assets, 2, fmt)
    import yaml

    first = yaml.safe_load((run_dir / "epoch_0_step_4" / "config.yaml").read_text())
    second = yaml.safe_load((run_dir / "epoch_0_step_8" / "config.yaml").read_text())
    assert first["step_scheduler"]["max_steps"] == 4 and second["step_scheduler"]["max_steps"] == 8
    assert second["checkpoint"]["model_save_format"] == fmt
    assert not any("${" in line for line in (run_dir / "epoch_0_step_8" / "config.yaml").read_text().splitlines())


@pytest.mark.parametrize("fmt", FORMATS)
def test_torch_tools_read_our_files_unmodified(work, assets, fmt, tmp_path):
    from safetensors import safe_open
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ckpt = _resumed(work, assets, 2, fmt)[0] / "epoch_0_step_8"
    dcp_to_torch_save(str(ckpt / "optim"), str(tmp_path / "optim.pt"))
    optim = torch.load(tmp_path / "optim.pt", weights_only=False)
    assert any("exp_avg" in str(k) for k in _flat_keys(optim))
    if fmt == "torch_save":
        dcp_to_torch_save(str(ckpt / "model"), str(tmp_path / "model.pt"))
        model = torch.load(tmp_path / "model.pt", weights_only=True)
        assert "model.embed_tokens.weight" in model
    else:
        shards = sorted((ckpt / "model").glob("shard-*.safetensors"))
        assert len(shards) == 2
        for shard in shards:
            with safe_open(str(shard), "pt") as f:
                assert "model.embed_tokens.weight" in f.keys()


def _flat_keys(obj, prefix=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield f"{prefix}.{k}"
            yield from _flat_keys(v, f"{prefix}.{k}")


def test_user_defined_state_round_trips(work, assets):
    args = (*COMMON, "--recipe", str(REPO / "examples" / "custom_state.py") + ":TokenCountingRecipe",
            "--checkpoint.checkpoint_dir", "custom")
    ckpt_train(work, assets, *args, "--step_scheduler.max_steps", "4", nproc=2)
    at4 = torch.load(work / "custom" / "epoch_0_step_4" / "token_counter.pt", weights_only=True)
    assert at4["steps"] == 4 and at4["tokens"] > 0
    ckpt_train(work, assets, *args, "--step_scheduler.max_steps", "8", nproc=2)
    at8 = torch.load(work / "custom" / "epoch_0_step_8" / "token_counter.pt", weights_only=True)
    assert at8["steps"] == 8  # 4 restored + 4 new: the count survived the restart
    assert at8["tokens"] > at4["tokens"]


def test_killed_during_save_resumes_from_previous_checkpoint(work, assets, straight_runs):
    args = (*COMMON, "--checkpoint.checkpoint_dir", "crash", "--step_scheduler.max_steps", "8")
    crashed = ckpt_train(work, assets, *args, "--recipe", "tests.integration.recipes_for_tests.CrashDuringSaveRecipe",
                         nproc=2, env={"CRASH_AT_STEP": "8", "PYTHONPATH": str(REPO)}, check=False)
    run_dir = work / "crash"
    assert crashed.returncode != 0
    assert (run_dir / ".staging-epoch_0_step_8").is_dir()  # the half-written save is there...
    assert not (run_dir / "epoch_0_step_8").exists()  # ...but never published
    assert os.readlink(run_dir / "LATEST") == "epoch_0_step_4"
    rerun = ckpt_train(work, assets, *args, nproc=2)
    assert "Loading checkpoint from crash/epoch_0_step_4" in rerun.output
    assert not list(run_dir.glob(".staging-*"))  # the leftover was cleaned up by the next save
    assert os.readlink(run_dir / "LATEST") == "epoch_0_step_8"
    assert losses(run_dir) == losses(straight_runs.get(2))


def test_restore_from_missing_lists_existing(work, assets):
    _resumed(work, assets, 1, "safetensors")
    bad = ckpt_train(work, assets, *COMMON, "--checkpoint.checkpoint_dir", "resumed_1_safetensors",
                     "--checkpoint.restore_from", "epoch_9_step_99", check=False)
    assert bad.returncode != 0
    assert "epoch_9_step_99' not found" in bad.stderr and "epoch_0_step_4, epoch_0_step_8" in bad.stderr
    assert "Traceback" not in bad.stderr
