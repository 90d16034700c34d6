"""evaluation: during training: scores logged like validation, retention by an eval score, a kill in an evaluation,
and `ckpt-train eval`'s scores as points on the run's trackers at the checkpoint's step."""

from __future__ import annotations

from pathlib import Path

import pytest

from automodel_ckpt.ondisk import catalog, layout
from automodel_ckpt.ondisk.durable import read_pointer
from tests.integration.harness import REPO, ckpt_train, jsonl, losses
from tests.integration.trackers import tensorboard_scalars

pytest.importorskip("tensorboard")
pytest.importorskip("mlflow")

# near_sum (a local task: answer or near miss, by loglikelihood) moves with every step: on its first 80 documents
# the steps 3, 6 and 9 score 0.6375, 0.6625 and 0.3625, so the best by it is the middle checkpoint
TASKS = REPO / "tests" / "integration" / "eval_tasks"
METRIC = "eval/near_sum/acc"
ARGS = ("--checkpoint.save_consolidated", "false", "--step_scheduler.max_steps", "9",
        "--step_scheduler.ckpt_every_steps", "3", "--data.val_size", "64", "--evaluation.every_steps", "3",
        "--evaluation.tasks=[near_sum]", "--evaluation.include_path", str(TASKS), "--evaluation.limit", "80",
        "--checkpoint.monitor", METRIC, "--checkpoint.mode", "max", "--checkpoint.save_top_k", "1",
        "--checkpoint.checkpoint_dir", "run", "--logging.tensorboard.log_dir", "null")
MLFLOW = ("--logging.mlflow.experiment", "evaluated")  # the straight run only (its store costs each launch seconds)


def _checkpoints(run: Path) -> dict[str, dict]:
    return {r.name: r.metadata for r in catalog.scan_checkpoints(run)}


@pytest.fixture(scope="module")
def straight(tmp_path_factory, assets) -> tuple[Path, str]:
    work = tmp_path_factory.mktemp("eval_straight")
    done = ckpt_train(work, assets, *ARGS, *MLFLOW, nproc=2)
    return work / "run", done.output


def test_scores_are_logged_recorded_and_keep_the_best_checkpoint(straight):
    run, output = straight
    for step in (3, 6, 9):
        assert f"step {step}: {METRIC} " in output
    scored = {r["step"]: r[METRIC] for r in jsonl(run / layout.VALIDATION_LOG) if METRIC in r}
    assert sorted(scored) == [3, 6, 9]
    assert scored[6] > max(scored[3], scored[9])  # distinct scores, the best neither the first nor the newest
    kept = _checkpoints(run)
    # save_top_k 1 by the score: the best (step 6) and the newest are kept, step 3 is pruned
    assert sorted(kept) == ["epoch_0_step_6", "epoch_0_step_9"]
    assert {int(n.rsplit("_", 1)[1]): m["val_metrics"][METRIC] for n, m in kept.items()} == \
        {6: scored[6], 9: scored[9]}
    # the best by an eval score has its own pointer (by val_loss, LOWEST_VAL would name the newest)
    assert read_pointer(run, layout.BEST_EVAL) == "epoch_0_step_6"
    assert read_pointer(run, layout.LOWEST_VAL) is None
    # logged like validation: the same points on the trackers, at their steps
    shown = tensorboard_scalars(run / layout.TENSORBOARD_DIR, METRIC)
    assert [s for s, _ in shown] == [3, 6, 9] and all(abs(v - scored[s]) < 1e-6 for s, v in shown)


def test_a_kill_during_an_evaluation_loses_nothing_and_redoes_no_finished_one(tmp_path, assets, straight):
    run, _ = straight
    killed = ckpt_train(tmp_path, assets, *ARGS, "--recipe", "tests.integration.eval_recipes.KillDuringEvalRecipe",
                        nproc=2, env={"KILL_AT_EVAL_STEP": "6", "PYTHONPATH": str(REPO)}, check=False)
    assert killed.returncode != 0 and f"step 3: {METRIC}" in killed.output
    assert sorted(_checkpoints(tmp_path / "run")) == ["epoch_0_step_3"]  # step 6's evaluation never finished
    rerun = ckpt_train(tmp_path, assets, *ARGS, nproc=2)
    assert f"step 3: {METRIC}" not in rerun.output  # finished, recorded in its checkpoint: not redone
    assert f"step 6: {METRIC}" in rerun.output
    assert losses(tmp_path / "run") == losses(run)
    assert jsonl(tmp_path / "run" / layout.VALIDATION_LOG) == jsonl(run / layout.VALIDATION_LOG)
    got, want = _checkpoints(tmp_path / "run"), _checkpoints(run)
    assert sorted(got) == sorted(want) == ["epoch_0_step_6", "epoch_0_step_9"]  # the best kept, step 3 pruned
    assert {n: m["val_metrics"] for n, m in got.items()} == {n: m["val_metrics"] for n, m in want.items()}
    assert read_pointer(tmp_path / "run", layout.BEST_EVAL) == "epoch_0_step_6"


def test_eval_puts_its_scores_on_the_runs_trackers_at_the_checkpoints_step(straight, capsys, monkeypatch):
    """Last in the file: it adds to the straight run (an eval/ folder, points on its trackers)."""
    from mlflow.tracking import MlflowClient

    from automodel_ckpt.cli import main

    run, _ = straight
    monkeypatch.chdir(run.parent)  # where training was launched
    assert main(["eval", "run/epoch_0_step_6", "--tasks", "addition", "--limit", "4"]) == 0
    out = capsys.readouterr().out
    assert "logging.tensorboard: 1 score(s) at step 6" in out and "logging.mlflow: 1 score(s) at step 6" in out
    tag = "eval/addition/exact_match"
    assert tensorboard_scalars(run / layout.TENSORBOARD_DIR, tag) == [(6, 0.0)]
    # the training's points are all still shown: nothing purged by the later event file
    assert [s for s, _ in tensorboard_scalars(run / layout.TENSORBOARD_DIR, "train/loss")] == list(range(1, 10))
    client = MlflowClient(tracking_uri=f"sqlite:///{run / layout.MLFLOW_DB}")
    runs = client.search_runs([client.get_experiment_by_name("evaluated").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"  # the training's run, reopened as it was
    assert [(m.step, m.value) for m in client.get_metric_history(runs[0].info.run_id, tag)] == [(6, 0.0)]
    assert [m.step for m in client.get_metric_history(runs[0].info.run_id, METRIC)] == [3, 6, 9]
