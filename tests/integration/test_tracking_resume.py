"""TensorBoard, MLflow and W&B (offline) on a 2-process run killed with SIGKILL, its newest checkpoint damaged,
then resumed (falling back to the checkpoint before): each tracker shows one run whose loss series has every step
once and equals training.jsonl. Then ``inspect --cost`` against what the run recorded."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import time
from pathlib import Path

import pytest

from automodel_ckpt.ondisk import layout
from tests.integration.harness import (CKPT_TRAIN, QUIET, RECIPE, ckpt_train, env_for, jsonl, kill_job, run_command,
                                       start_command)
from tests.integration.trackers import tensorboard_scalars, tensorboard_texts, wandb_history, wandb_run_ids

pytest.importorskip("tensorboard")
pytest.importorskip("mlflow")
pytest.importorskip("wandb")

MAX_STEPS = 10
ARGS = ("--step_scheduler.max_steps", str(MAX_STEPS), "--step_scheduler.ckpt_every_steps", "3",
        "--step_scheduler.val_every_steps", "3", "--step_scheduler.global_batch_size", "16",
        "--step_scheduler.local_batch_size", "8", "--data.val_size", "32", "--checkpoint.save_consolidated", "false",
        "--checkpoint.checkpoint_dir", "run", "--logging.tensorboard.log_dir", "null",
        "--logging.mlflow.experiment", "tracked", "--logging.wandb.mode", "offline")
KILL_AT_STEP = 8  # checkpoints at 3 and 6 exist; step 6's is then damaged: the resume falls back to step 3


def _train_and_kill(work: Path, assets: Path) -> int:
    """Start the job, SIGKILL it once training.jsonl shows KILL_AT_STEP; the last step it had logged."""
    log = work / "killed.log"
    cmd = [CKPT_TRAIN, "--nproc-per-node", "2", str(RECIPE), *QUIET, *ARGS]
    with open(log, "w") as out:
        proc = start_command(cmd, cwd=work, env=env_for(assets, {"WANDB_SILENT": "true"}), stdout=out,
                             stderr=subprocess.STDOUT, start_new_session=True)
    steps = work / "run" / layout.TRAINING_LOG
    deadline = time.monotonic() + 600
    last = 0
    while proc.poll() is None and time.monotonic() < deadline:
        if steps.exists():
            last = max([r["step"] for r in jsonl(steps)] or [0])
            if last >= KILL_AT_STEP:
                kill_job(proc)
                last = max(r["step"] for r in jsonl(steps))  # what it had logged when it died
                break
        time.sleep(0.005)
    assert proc.returncode is not None and proc.returncode != 0, log.read_text()[-3000:]
    assert KILL_AT_STEP <= last < MAX_STEPS, f"killed at step {last}"
    return last


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory: pytest.TempPathFactory, assets: Path) -> dict:
    work = tmp_path_factory.mktemp("tracked")
    killed_at = _train_and_kill(work, assets)
    run = work / "run"
    shard = max((run / "epoch_0_step_6" / layout.MODEL_DIR).glob("*.safetensors"), key=lambda f: f.stat().st_size)
    shard.unlink()  # damaged: the resume quarantines it and falls back to step 3
    resumed = ckpt_train(work, assets, *ARGS, nproc=2, env={"WANDB_SILENT": "true"})
    return {"run": run, "killed_at": killed_at, "output": resumed.output, "assets": assets}


def _jsonl_series(run: Path, name: str, key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in jsonl(run / name)]


def test_the_resume_fell_back_and_training_jsonl_has_every_step_once(tracked_run):
    run = tracked_run["run"]
    assert "cannot be loaded" in tracked_run["output"] and (run / layout.QUARANTINE_DIR / "epoch_0_step_6").is_dir()
    assert [s for s, _ in _jsonl_series(run, layout.TRAINING_LOG, "loss")] == list(range(1, MAX_STEPS + 1))


def test_tensorboard_replaces_the_steps_after_the_restored_checkpoint(tracked_run):
    run = tracked_run["run"]
    log_dir = run / layout.TENSORBOARD_DIR
    assert len(list(log_dir.glob("events.out.tfevents.*"))) == 2  # one file per launch, in one folder
    shown = tensorboard_scalars(log_dir, "train/loss")
    expected = _jsonl_series(run, layout.TRAINING_LOG, "loss")
    assert [s for s, _ in shown] == [s for s, _ in expected]  # every step once, in order
    assert all(math.isclose(v, e, rel_tol=1e-6) for (_, v), (_, e) in zip(shown, expected))  # float32 in TB
    val = tensorboard_scalars(log_dir, "val/loss")
    assert [s for s, _ in val] == [s for s, _ in _jsonl_series(run, layout.VALIDATION_LOG, "val_loss")]
    texts = tensorboard_texts(log_dir)
    assert any(tag.startswith("events/resume") and "resumed from epoch_0_step_3 at step 3" in t for tag, _, t in texts)
    assert any(tag.startswith("events/fallback") and "epoch_0_step_6" in t for tag, _, t in texts)
    assert [s for s, _ in tensorboard_scalars(log_dir, "checkpoint/blocked_s")] == [3, 6, 9, 10]


def test_mlflow_has_one_run_and_marks_the_replaced_steps(tracked_run, monkeypatch):
    from mlflow.tracking import MlflowClient

    from automodel_ckpt.tracking.mlflow_backend import last_per_step

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # the default store opens with no opt-in
    run = tracked_run["run"]
    assert not (run / layout.MLFLOW_DIR).exists()
    client = MlflowClient(tracking_uri=f"sqlite:///{run / layout.MLFLOW_DB}")
    experiment = client.get_experiment_by_name("tracked")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    run_id = runs[0].info.run_id
    history = client.get_metric_history(run_id, "train/loss")
    expected = _jsonl_series(run, layout.TRAINING_LOG, "loss")
    assert [(m.step, m.value) for m in last_per_step(history)] == expected
    counts = {s: sum(m.step == s for m in history) for s, _ in expected}
    assert all(counts[s] == 1 for s in (1, 2, 3)), counts  # up to the restored checkpoint: logged once
    assert max(counts.values()) <= 2 and all(counts[s] == 1 for s in range(tracked_run["killed_at"] + 1, MAX_STEPS + 1))
    tags = runs[0].data.tags
    assert "resumed.step_3" in tags and any(k.startswith("event.fallback.") for k in tags)
    assert runs[0].data.params["step_scheduler.max_steps"] == str(MAX_STEPS)


def test_wandb_offline_keeps_one_run_id_and_the_newest_launch_holds_every_step_once(tracked_run):
    run = tracked_run["run"]
    files = sorted((run / layout.WANDB_DIR).glob("offline-run-*/run-*.wandb"), key=lambda f: f.stat().st_mtime)
    assert len(files) == 2  # one folder per launch
    assert set.union(*(wandb_run_ids(f) for f in files)) == {files[0].stem.removeprefix("run-")}  # the same run
    rows = [r for r in wandb_history(files[-1]) if "train/loss" in r]
    assert [(r["_step"], r["train/loss"]) for r in rows] == _jsonl_series(run, layout.TRAINING_LOG, "loss")
    val = [(r["_step"], r["val/loss"]) for r in wandb_history(files[-1]) if "val/loss" in r]
    assert val == _jsonl_series(run, layout.VALIDATION_LOG, "val_loss")


def test_inspect_cost_reports_what_the_run_recorded(tracked_run):
    run = tracked_run["run"]
    events = jsonl(run / layout.EVENTS_LOG)
    saves = [e for e in events if e["event"] == "checkpoint"]
    assert [e["event"] for e in events].count("start") == 2 and events[-1]["event"] == "end"
    env = env_for(tracked_run["assets"])
    out = run_command([CKPT_TRAIN, "inspect", str(run), "--cost", "--json"], env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert report["interruptions"] == 1 and report["mtbf_source"] == "observed"
    assert report["checkpoints"] == len(saves)
    cost = statistics.fmean(e["blocked_s"] for e in saves)
    assert math.isclose(report["blocked_per_checkpoint_s"], cost, rel_tol=1e-9)
    assert math.isclose(report["mtbf_s"], report["wall_s"], rel_tol=1e-9)  # one interruption
    assert math.isclose(report["advice"]["interval_s"], math.sqrt(2 * cost * report["mtbf_s"]), rel_tol=1e-9)
    assert report["advice"]["interval_steps"] == max(1, round(report["advice"]["interval_s"] / report["step_s"]))
    assert "Checkpoint cost:" in tracked_run["output"] and "Young/Daly interval" in tracked_run["output"]
    shown = run_command([CKPT_TRAIN, "inspect", str(run), "--cost", "--mtbf-hours", "2"], env=env, timeout=300)
    assert shown.returncode == 0, shown.stderr[-2000:]
    text = shown.stdout
    assert "MTBF 2.0 h (given)" in text and "Young/Daly interval" in text
