"""examples/custom_recipe.py, a recipe written from BaseRecipe in 40 lines, gets every guarantee: killed in the middle
of a save and rerun, or preempted and rerun, its losses and its own state are bitwise those of a straight run."""

from __future__ import annotations

import ast
import os
from functools import cache
from pathlib import Path

import pytest

from automodel_ckpt.ondisk import layout
from tests.integration.harness import REPO, ckpt_train

RECIPE_YAML = REPO / "examples" / "custom_recipe.yaml"
FAULTY = "tests.integration.custom_recipe_faults.FaultyLineFitRecipe"


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("custom_recipe")


def _run(work: Path, assets: Path, name: str, *, recipe: str = f"{REPO}/examples/custom_recipe.py:LineFitRecipe",
         env: dict[str, str] | None = None, check: bool = True):
    return ckpt_train(work, assets, "--recipe", recipe, "--checkpoint.checkpoint_dir", name,
                      "--checkpoint.local.dir", str(work / f"{name}_local"), recipe=RECIPE_YAML,
                      env={"PYTHONPATH": str(REPO), **(env or {})}, check=check)


def records(output: str) -> list[dict]:
    """The steps the recipe printed: ``{'step': N, 'loss': ..., 'seen': ...}`` per line."""
    return [ast.literal_eval(line) for line in output.splitlines() if line.startswith("{'step': ")]


@cache
def _straight(work: Path, assets: Path) -> list[dict]:
    return records(_run(work, assets, "straight").output)


def _resumed(first: list[dict], rerun: list[dict]) -> list[dict]:
    """The steps of an interrupted run and of its rerun, the rerun's taking the place of those it trained again."""
    return [r for r in first if r["step"] < rerun[0]["step"]] + rerun


def test_the_example_trains_saves_and_keeps_two_checkpoints(work, assets):
    straight = _straight(work, assets)
    assert [r["step"] for r in straight] == list(range(1, 13))
    assert straight[-1]["loss"] < straight[0]["loss"] / 4  # it learns
    names = sorted(p.name for p in (work / "straight").iterdir() if p.name.startswith("epoch_"))
    assert names == ["epoch_0_step_12", "epoch_0_step_8"]  # max_recent_checkpoints: 2


def test_killed_in_the_middle_of_a_save_then_rerun_gives_the_same_losses(work, assets):
    crashed = _run(work, assets, "crash", recipe=FAULTY, env={"CRASH_AT_STEP": "8"}, check=False)
    run_dir = work / "crash"
    assert crashed.returncode != 0
    assert (run_dir / ".staging-epoch_0_step_8").is_dir() and not (run_dir / "epoch_0_step_8").exists()
    assert os.readlink(run_dir / layout.LATEST) == "epoch_0_step_4"
    rerun = _run(work, assets, "crash")
    resumed = records(rerun.output)
    assert 5 <= resumed[0]["step"] <= 8  # the durable step 4, or a node-local step after it
    assert _resumed(records(crashed.output), resumed) == _straight(work, assets)  # losses and its own state
    assert os.readlink(run_dir / layout.LATEST) == "epoch_0_step_12"


def test_a_preemption_signal_saves_exits_0_and_the_rerun_gives_the_same_losses(work, assets):
    preempted = _run(work, assets, "preempt", recipe=FAULTY, env={"PREEMPT_AT_STEP": "6"}, check=False)
    assert preempted.returncode == 0, preempted.output[-3000:]
    assert [r["step"] for r in records(preempted.output)] == list(range(1, 7))
    run_dir = work / "preempt"
    assert os.readlink(run_dir / layout.LATEST) == "epoch_0_step_6"
    rerun = _run(work, assets, "preempt")
    assert records(rerun.output)[0]["step"] == 7
    assert _resumed(records(preempted.output), records(rerun.output)) == _straight(work, assets)
