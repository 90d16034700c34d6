"""evaluation: during training: scores logged like validation, retention by an eval score, a kill in an evaluation."""

from __future__ import annotations

from pathlib import Path

import pytest

from automodel_ckpt.ondisk import catalog, layout
from automodel_ckpt.ondisk.durable import read_pointer
from tests.integration.harness import REPO, ckpt_train, jsonl, losses

METRIC = "eval/addition/exact_match"
ARGS = ("--checkpoint.save_consolidated", "false", "--step_scheduler.max_steps", "12",
        "--step_scheduler.ckpt_every_steps", "4", "--data.val_size", "64", "--evaluation.every_steps", "4",
        "--evaluation.tasks=[addition]", "--evaluation.limit", "8", "--checkpoint.monitor", METRIC,
        "--checkpoint.mode", "max", "--checkpoint.save_top_k", "1", "--checkpoint.checkpoint_dir", "run")


def _checkpoints(run: Path) -> dict[str, dict]:
    return {r.name: r.metadata for r in catalog.list_checkpoints(run)}


@pytest.fixture(scope="module")
def straight(tmp_path_factory, assets) -> tuple[Path, str]:
    work = tmp_path_factory.mktemp("eval_straight")
    done = ckpt_train(work, assets, *ARGS, nproc=2)
    return work / "run", done.output


def test_scores_are_logged_recorded_and_rank_the_checkpoints(straight):
    run, output = straight
    for step in (4, 8, 12):
        assert f"step {step}: {METRIC} " in output
    scored = [r for r in jsonl(run / layout.VALIDATION_LOG) if METRIC in r]
    assert [r["step"] for r in scored] == [4, 8, 12]
    kept = _checkpoints(run)
    # save_top_k 1 by the score (ties go to the earlier step): step 4 and the newest are kept, step 8 is not
    assert sorted(kept) == ["epoch_0_step_12", "epoch_0_step_4"]
    assert all(METRIC in meta["val_metrics"] for meta in kept.values())
    # the best by an eval score has its own pointer (by val_loss, LOWEST_VAL would name the newest)
    assert read_pointer(run, layout.BEST_EVAL) == "epoch_0_step_4"
    assert read_pointer(run, layout.LOWEST_VAL) is None


def test_a_kill_during_an_evaluation_loses_nothing_and_redoes_no_finished_one(tmp_path, assets, straight):
    run, _ = straight
    killed = ckpt_train(tmp_path, assets, *ARGS, "--recipe", "tests.integration.eval_recipes.KillDuringEvalRecipe",
                        nproc=2, env={"KILL_AT_EVAL_STEP": "8", "PYTHONPATH": str(REPO)}, check=False)
    assert killed.returncode != 0 and f"step 4: {METRIC}" in killed.output
    assert sorted(_checkpoints(tmp_path / "run")) == ["epoch_0_step_4"]  # step 8's evaluation never finished
    rerun = ckpt_train(tmp_path, assets, *ARGS, nproc=2)
    assert f"step 4: {METRIC}" not in rerun.output  # finished, recorded in its checkpoint: not redone
    assert f"step 8: {METRIC}" in rerun.output
    assert losses(tmp_path / "run") == losses(run)
    assert jsonl(tmp_path / "run" / layout.VALIDATION_LOG) == jsonl(run / layout.VALIDATION_LOG)
    got, want = _checkpoints(tmp_path / "run"), _checkpoints(run)
    assert sorted(got) == sorted(want)
    assert {n: m["val_metrics"] for n, m in got.items()} == {n: m["val_metrics"] for n, m in want.items()}
    assert read_pointer(tmp_path / "run", layout.BEST_EVAL) == read_pointer(run, layout.BEST_EVAL)
