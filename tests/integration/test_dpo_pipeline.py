"""Preference tuning under pipeline stages (recipes/tiny_llama_dpo.yaml, ``distributed.pp_size 2``): the fine-tune's
step with the pair loss, the reference staged like the policy and mixed toward it (TR-DPO); killed in the middle of a
save and rerun, the losses and metrics are bitwise those of a straight run."""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

import pytest

from automodel_ckpt.ondisk import layout
from tests.integration.harness import REPO, ckpt_train, jsonl

DPO_RECIPE = REPO / "recipes" / "tiny_llama_dpo.yaml"
ARGS = ("--distributed.pp_size", "2", "--dataset.num_samples", "256", "--validation_dataset.num_samples", "16",
        "--step_scheduler.global_batch_size", "8", "--step_scheduler.local_batch_size", "8",
        "--step_scheduler.max_steps", "4", "--step_scheduler.ckpt_every_steps", "2",
        "--checkpoint.save_consolidated", "false", "--dpo.sync_ref_model", "true", "--dpo.ref_model_sync_steps", "2")
COMPARED = ("loss", "grad_norm", "reward_chosen", "reward_rejected", "reward_accuracy", "reward_margin")


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dpo_pipeline")


def _run(work: Path, assets: Path, name: str, *extra: str, env: dict[str, str] | None = None, check: bool = True):
    return ckpt_train(work, assets, *ARGS, "--checkpoint.checkpoint_dir", name, *extra, nproc=2, recipe=DPO_RECIPE,
                      env={"PYTHONPATH": str(REPO), **(env or {})}, check=check)


def _numbers(run_dir: Path) -> list[tuple]:
    return [tuple(r[k] for k in COMPARED) for r in jsonl(run_dir / layout.TRAINING_LOG)]


@cache
def _straight(work: Path, assets: Path) -> list[tuple]:
    run = _run(work, assets, "straight")
    assert "Pipeline stage 1:" in run.output
    return _numbers(work / "straight")


def test_a_preference_run_trains_under_pipeline_stages(work, assets):
    numbers = _straight(work, assets)
    assert len(numbers) == 4
    assert numbers[0][2:] == (0.0, 0.0, 0.0, 0.0)  # step 1: the policy is the reference
    val = jsonl(work / "straight" / layout.VALIDATION_LOG)
    assert [r["step"] for r in val] == [2, 4] and all(0 <= r["val_reward_accuracy"] <= 1 for r in val)


def test_killed_in_the_middle_of_a_save_and_rerun_gives_the_same_numbers(work, assets):
    crashed = _run(work, assets, "crash", "--recipe", "tests.integration.pipeline_dpo_recipes.CrashDuringSaveDPORecipe",
                   env={"CRASH_AT_STEP": "4"}, check=False)
    run_dir = work / "crash"
    assert crashed.returncode != 0
    assert os.readlink(run_dir / layout.LATEST) == "epoch_0_step_2"
    rerun = _run(work, assets, "crash")
    assert "Reference model: restored from the checkpoint (synced 1 time(s)" in rerun.output
    assert _numbers(run_dir) == _straight(work, assets)
