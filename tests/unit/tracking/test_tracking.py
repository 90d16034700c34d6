"""Experiment tracking in-process: the interval formula, the cost log, and the trackers' resume behaviour read
back with TensorBoard's and MLflow's own readers (W&B, which starts a service process, is in the integration test)."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from automodel_ckpt.ondisk import layout
from automodel_ckpt.errors import ConfigError
from automodel_ckpt.tracking import tracker as tracker_module
from automodel_ckpt.tracking.base import Backend
from automodel_ckpt.tracking.costlog import summarize
from automodel_ckpt.tracking.costreport import cost_report, one_line, render
from automodel_ckpt.tracking.interval import advise, expected_overhead, young_daly_interval
from automodel_ckpt.tracking.tracker import RunTracker

# --- the formula ----------------------------------------------------------------------------------


def test_young_daly_interval_is_the_documented_formula():
    assert young_daly_interval(cost_s=18.0, mtbf_s=3600.0) == pytest.approx(360.0)  # sqrt(2 * 18 * 3600)
    assert young_daly_interval(0.0, 100.0) == 0.0
    with pytest.raises(ValueError):
        young_daly_interval(1.0, 0.0)


def test_the_interval_minimises_the_expected_overhead():
    cost, mtbf = 5.0, 8 * 3600.0
    best = young_daly_interval(cost, mtbf)
    at_best = expected_overhead(best, cost, mtbf)
    assert at_best == pytest.approx(math.sqrt(2 * cost / mtbf))
    for factor in (0.5, 0.9, 1.1, 2.0):
        assert expected_overhead(best * factor, cost, mtbf) > at_best
    assert expected_overhead(best, cost, mtbf, latency_s=60.0) == pytest.approx(at_best + 60.0 / mtbf)


def test_advice_in_whole_steps_and_against_the_current_interval():
    advice = advise(cost_s=2.0, mtbf_s=3600.0, step_s=0.5, current_every_steps=10)
    assert advice.interval_s == pytest.approx(120.0)
    assert advice.interval_steps == 240
    assert advice.current_interval_s == pytest.approx(5.0)
    assert advice.current_overhead == pytest.approx(2.0 / 5.0 + 2.5 / 3600.0)
    assert advice.overhead < advice.current_overhead
    assert advise(cost_s=0.001, mtbf_s=10.0, step_s=60.0).interval_steps == 1  # never below one step


# --- the cost log --------------------------------------------------------------------------------


def _events() -> list[dict]:
    """Two launches: the first killed after its step-20 checkpoint, the second complete."""
    return [
        {"event": "start", "time": 0.0, "step": 0, "every_steps": 10},
        {"event": "checkpoint", "time": 50.0, "step": 10, "blocked_s": 2.0, "background_s": None, "bytes": 4e9,
         "write_gbps": 2.0},
        {"event": "checkpoint", "time": 100.0, "step": 20, "blocked_s": 4.0, "background_s": None, "bytes": 4e9,
         "write_gbps": 1.0},
        {"event": "start", "time": 500.0, "step": 20, "resumed_from": "epoch_0_step_20"},
        {"event": "checkpoint", "time": 550.0, "step": 30, "blocked_s": 3.0, "background_s": None, "bytes": 4e9,
         "write_gbps": 1.5},
        {"event": "end", "time": 600.0, "step": 30, "status": "complete"},
    ]


def test_summary_counts_interruptions_and_the_share_of_wall_time():
    costs = summarize(_events())
    assert (costs.launches, costs.interruptions, costs.checkpoints, costs.steps) == (2, 1, 3, 30)
    assert costs.wall_s == pytest.approx(200.0)  # 100 s + 100 s: the dead time between launches is not training
    assert costs.blocked_s == pytest.approx(9.0) and costs.share == pytest.approx(0.045)
    assert costs.blocked_per_checkpoint_s == pytest.approx(3.0)
    assert costs.step_s == pytest.approx(191.0 / 30)
    assert costs.write_gbps == pytest.approx(1.5) and costs.every_steps == 10


def test_report_uses_the_observed_mtbf_and_else_announces_the_default():
    report = cost_report(summarize(_events()))
    assert report["mtbf_source"] == "observed" and report["mtbf_s"] == pytest.approx(200.0)
    assert report["advice"]["interval_s"] == pytest.approx(math.sqrt(2 * 3.0 * 200.0))
    given = cost_report(summarize(_events()), mtbf_hours=2.0)
    assert given["mtbf_source"] == "given" and given["mtbf_s"] == 7200.0
    preempted = _events()[:3] + [{"event": "end", "time": 100.0, "step": 20, "status": "preempted"}]  # no work lost
    assumed = cost_report(summarize(preempted))
    assert assumed["interruptions"] == 0 and assumed["mtbf_source"] == "assumed"
    assert "assumed" in one_line(assumed) and "set it with --checkpoint.mtbf_hours" in one_line(assumed)

    assert "size per checkpoint:        3.7 GiB, written at 1.4 GiB/s" in render(report)  # the one size format


def test_the_assumed_mtbf_names_the_flag_of_the_reader_s_own_command(tmp_path):
    """The line at the end of a training run names the run's override (``--checkpoint.mtbf_hours``), never
    ``inspect``'s ``--mtbf-hours``; ``inspect --cost`` names its own."""
    from automodel_ckpt.tracking import RunObserver

    observer = RunObserver(_section(), tmp_path, is_main=True, config_yaml="")
    observer.start(0, None, every_steps=2)
    for step in (2, 4):
        observer.save(lambda: None, step, lambda: None)
    line = observer.end(4, "complete")
    assert "assumed, no interruption seen; set it with --checkpoint.mtbf_hours)" in line and "--mtbf-hours" not in line
    report = render(cost_report(summarize(json.loads(r) for r in (tmp_path / layout.EVENTS_LOG).read_text()
                                          .splitlines())))
    assert "set it with --mtbf-hours)" in report and "--checkpoint.mtbf_hours" not in report


@pytest.mark.parametrize("when", ["<script>", [1], {"t": 1}, None, True, float("nan"), float("inf"), 10 ** 400])
def test_a_quarantine_note_whose_time_is_no_number_is_no_fallback_of_this_launch(tmp_path, when):
    """A received run folder's quarantine note holds any JSON value as its time: only a finite number is a time,
    so a launch starting on such a folder neither crashes nor reports that checkpoint as moved aside by itself."""
    from automodel_ckpt.ondisk.catalog import quarantined_checkpoints
    from automodel_ckpt.tracking import RunObserver

    (tmp_path / layout.QUARANTINE_DIR / "epoch_0_step_2").mkdir(parents=True)
    text = json.dumps({"step": 2, "reason": "torn", "quarantined_at": when}).replace("Infinity", "1e999")
    (tmp_path / layout.QUARANTINE_DIR / layout.quarantine_note("epoch_0_step_2")).write_text(text)
    assert [q["quarantined_at"] for q in quarantined_checkpoints(tmp_path)] == [None]
    observer = RunObserver(_section(), tmp_path, is_main=True, config_yaml="")
    observer.start(2, None, every_steps=2)
    assert json.loads((tmp_path / layout.EVENTS_LOG).read_text().splitlines()[0])["fallbacks"] == []


# --- the trackers ---------------------------------------------------------------------------------


def _section(**backends) -> object:
    return OmegaConf.create({"tensorboard": None, "mlflow": None, "wandb": None, **backends})


def _launch(run: Path, section, saved: dict | None, steps: range, restored: int | None) -> RunTracker:
    tracker = RunTracker(section, run, enabled=True, hparams=lambda: {"optimizer": {"lr": 0.1}, "seed": 1})
    if saved is not None:
        tracker.load_state_dict(saved)
    tracker.start(restored or 0, resumed=restored is not None, events=[("resume", "resumed")] if restored else [])
    for step in steps:
        tracker.log({"train/loss": float(step) + (100.0 if restored else 0.0)}, step)
    tracker.flush(timeout=300)  # the trackers kept up (a checkpoint itself waits for them at most FLUSH_TIMEOUT_S)
    return tracker


def test_tensorboard_resume_replaces_the_steps_after_the_checkpoint(tmp_path):
    from tests.integration.trackers import tensorboard_scalars

    section = _section(tensorboard={"log_dir": None})
    first = _launch(tmp_path, section, None, range(1, 5), None)
    saved = first.state_dict()  # the checkpoint at step 4: flushed, and the step it made durable
    assert saved["tensorboard"]["confirmed_step"] == 4
    for step in range(5, 8):  # logged after the checkpoint, then the job dies (no close)
        first.log({"train/loss": float(step)}, step)
    first.flush()
    second = _launch(tmp_path, section, saved, range(5, 10), restored=4)
    second.close("complete")
    shown = tensorboard_scalars(tmp_path / layout.TENSORBOARD_DIR, "train/loss")
    assert shown == [(s, float(s)) for s in range(1, 5)] + [(s, 100.0 + s) for s in range(5, 10)]


def test_mlflow_resume_reopens_the_run_and_replays_what_it_had_not_confirmed(tmp_path):
    from mlflow.tracking import MlflowClient

    from automodel_ckpt.tracking.mlflow_backend import last_per_step

    section = _section(mlflow={"tracking_uri": None, "experiment": "exp"})
    (tmp_path / layout.TRAINING_LOG).write_text("".join(json.dumps({"step": s, "loss": float(s)}) + "\n"
                                                        for s in range(1, 5)))
    first = _launch(tmp_path, section, None, range(1, 3), None)
    saved = first.state_dict()
    saved["mlflow"]["confirmed_step"] = 2  # as if steps 3-4 were still queued when the checkpoint at 4 was taken
    first.flush()
    second = _launch(tmp_path, section, saved, range(5, 7), restored=4)
    second.close("complete")
    assert not (tmp_path / layout.MLFLOW_DIR).exists()  # the default store is MLflow's own SQLite database
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / layout.MLFLOW_DB}")
    runs = client.search_runs([client.get_experiment_by_name("exp").experiment_id])
    assert len(runs) == 1 and runs[0].info.run_id == saved["mlflow"]["run_id"]
    history = client.get_metric_history(runs[0].info.run_id, "train/loss")
    assert [(m.step, m.value) for m in last_per_step(history)] == \
        [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 105.0), (6, 106.0)]  # 3-4 replayed from training.jsonl
    assert runs[0].data.params["optimizer.lr"] == "0.1" and "resumed.step_4" in runs[0].data.tags
    assert runs[0].info.status == "FINISHED"


def test_a_checkpoint_saved_before_mlflow_opened_its_run_still_resumes_that_run(tmp_path):
    from mlflow.tracking import MlflowClient

    section = _section(mlflow={"tracking_uri": None, "experiment": "exp"})
    (tmp_path / layout.TRAINING_LOG).write_text("".join(json.dumps({"step": s, "loss": float(s)}) + "\n"
                                                        for s in range(1, 4)))
    first = _launch(tmp_path, section, None, range(1, 4), None)
    lane = first._lanes[0]
    saved = {"mlflow": {"run_key": lane.state["run_key"], "location": lane.location, "confirmed_step": 0}}  # no id yet
    first.close("failed", timeout=300)
    second = _launch(tmp_path, section, saved, range(4, 6), restored=3)
    second.close("complete", timeout=300)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / layout.MLFLOW_DB}")
    runs = client.search_runs([client.get_experiment_by_name("exp").experiment_id])
    assert len(runs) == 1 and "resumed.step_3" in runs[0].data.tags  # found by its key, reopened
    steps = sorted(m.step for m in client.get_metric_history(runs[0].info.run_id, "train/loss"))
    assert steps == [1, 2, 3, 4, 5]  # nothing confirmed, yet the replay sent only what the run lacked: each step once


def test_a_missing_backend_is_one_line_naming_the_extra(monkeypatch):
    class Missing(Backend):
        name, module, extra = "tensorboard", "no_such_package_for_tracking", "tensorboard"

    monkeypatch.setattr(tracker_module, "BACKENDS", (Missing,))
    with pytest.raises(ConfigError, match=r"pip install 'automodel-ckpt\[tensorboard\]'"):
        RunTracker(_section(tensorboard={}), Path("."), enabled=False, hparams=dict)


def test_a_failing_backend_is_a_warning_and_training_goes_on(tmp_path, monkeypatch):
    class Broken(Backend):
        name, module, extra = "tensorboard", "json", "tensorboard"

        def open(self, ctx):
            return {}

        def log_metrics(self, metrics, step):
            raise OSError("disk gone")

    monkeypatch.setattr(tracker_module, "BACKENDS", (Broken,))
    tracker = RunTracker(_section(tensorboard={}), tmp_path, enabled=True, hparams=dict)
    tracker.start(0, resumed=False, events=[])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tracker.log({"train/loss": 1.0}, 1)
        tracker.log({"train/loss": 2.0}, 2)
        assert tracker.state_dict() == {}  # a dropped backend saves no state
        tracker.close("complete")
    assert sum("logging.tensorboard failed (OSError: disk gone)" in str(w.message) for w in caught) == 1


def test_nothing_configured_is_no_state_and_no_thread(tmp_path):
    tracker = RunTracker(_section(), tmp_path, enabled=True, hparams=dict)
    assert not tracker.requested and not tracker.active
    tracker.start(0, resumed=False, events=[])
    tracker.log({"train/loss": 1.0}, 1)
    assert tracker.state_dict() == {} and tracker._lanes == []


def test_checkpoint_costs_time_sync_and_async_saves(tmp_path):
    from concurrent.futures import Future

    from automodel_ckpt.checkpoint.save.overlap import Overlapped
    from automodel_ckpt.tracking.costlog import CheckpointCosts

    seen: list[dict] = []
    costs = CheckpointCosts(tmp_path, enabled=True, on_record=seen.append)
    costs.start(0, None, every_steps=5)
    costs.save(lambda: None, 5, lambda: None)  # synchronous: recorded at once
    assert [r["step"] for r in seen] == [5] and seen[0]["background_s"] is None
    job = Overlapped(completed=Future())
    costs.save(lambda: None, 10, lambda: job)  # async: recorded when the next save (or the final wait) returns
    assert len(seen) == 1
    job.fence_seconds = 0.25  # the next optimizer step waited this long for the background copy
    job.completed.set_result(tmp_path)
    costs.finalize(lambda: None, 12)
    record = seen[-1]
    assert (record["step"], record["at_step"]) == (10, 12)
    assert record["fence_s"] == 0.25 and record["blocked_s"] >= 0.25 and record["background_s"] >= 0
    costs.end(12, "complete")
    events = [json.loads(line) for line in (tmp_path / layout.EVENTS_LOG).read_text().splitlines()]
    assert [e["event"] for e in events] == ["start", "checkpoint", "checkpoint", "end"]
    assert events[-1]["blocked_s"] == pytest.approx(sum(e["blocked_s"] for e in events[1:3]), abs=1e-3)


# --- a checkpoint never decides where the trackers write -------------------------------------------


def _hostile_state(tmp_path: Path, **state) -> dict:
    return {name: {"confirmed_step": 2, **fields} for name, fields in state.items()}


def test_a_saved_tensorboard_log_dir_is_never_written(tmp_path):
    from tests.integration.trackers import tensorboard_scalars

    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    run.mkdir()
    saved = _hostile_state(tmp_path, tensorboard={"log_dir": str(elsewhere), "location": str(elsewhere)})
    (run / layout.TRAINING_LOG).write_text("".join(json.dumps({"step": s, "loss": float(s)}) + "\n"
                                                   for s in range(1, 5)))
    with pytest.warns(UserWarning, match=r"logging.tensorboard: the restored checkpoint's tracked run was kept "
                                         r"elsewhere; starting a new tracked run at .*run/tensorboard"):
        tracker = _launch(run, _section(tensorboard={"log_dir": None}), saved, range(5, 6), restored=4)
        tracker.close("complete")
    assert not elsewhere.exists()
    # the history of the run is replayed into the recipe's location from step 1 (nothing was confirmed there)
    shown = tensorboard_scalars(run / layout.TENSORBOARD_DIR, "train/loss")
    assert [s for s, _ in shown] == [1, 2, 3, 4, 5]
    assert tracker.state_dict() == {} and saved["tensorboard"]["location"] == str(elsewhere)


def test_a_saved_mlflow_server_never_receives_anything(tmp_path):
    from mlflow.tracking import MlflowClient

    other = tmp_path / "other.db"
    MlflowClient(tracking_uri=f"sqlite:///{other}").create_experiment("exp")  # "the other server"
    before = other.read_bytes()
    run = tmp_path / "run"
    run.mkdir()
    saved = _hostile_state(tmp_path, mlflow={"tracking_uri": f"sqlite:///{other}", "run_id": "0" * 32})
    with pytest.warns(UserWarning, match="logging.mlflow: the restored checkpoint's tracked run was kept elsewhere"):
        tracker = _launch(run, _section(mlflow={"tracking_uri": None, "experiment": "exp"}), saved, range(5, 6),
                          restored=4)
        state = tracker.state_dict()
        tracker.close("complete")
    assert other.read_bytes() == before
    assert state["mlflow"]["location"] == f"sqlite:///{(run / layout.MLFLOW_DB).resolve()}"
    assert state["mlflow"]["run_id"] != "0" * 32


@pytest.mark.parametrize("bad", [{"run_id": "../../x"}, {"run_id": 7}, {"confirmed_step": 10**9},
                                 {"confirmed_step": "2"}])
def test_a_saved_run_id_or_step_that_is_not_one_starts_a_new_tracked_run(tmp_path, bad):
    run = tmp_path / "run"
    run.mkdir()
    location = f"sqlite:///{(run / layout.MLFLOW_DB).resolve()}"
    saved = {"mlflow": {"run_id": "a" * 32, "confirmed_step": 2, "location": location, **bad}}
    with pytest.warns(UserWarning, match="logging.mlflow: the restored checkpoint's tracked run has no valid"):
        tracker = _launch(run, _section(mlflow={"tracking_uri": None, "experiment": "exp"}), saved, range(5, 6),
                          restored=4)
        state = tracker.state_dict()
        tracker.close("complete")
    assert state["mlflow"]["run_id"] != "a" * 32


def test_an_earlier_versions_mlflow_file_store_is_continued(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # set by the backend for its own process: restored after
    (tmp_path / layout.MLFLOW_DIR).mkdir()
    with pytest.warns(UserWarning, match="mlflow migrate-filestore --source"):
        tracker = _launch(tmp_path, _section(mlflow={"tracking_uri": None, "experiment": "exp"}), None, range(1, 3),
                          None)
        saved = tracker.state_dict()
        tracker.close("complete")
    assert saved["mlflow"]["location"] == (tmp_path / layout.MLFLOW_DIR).resolve().as_uri()
    assert not (tmp_path / layout.MLFLOW_DB).exists()
    client = MlflowClient(tracking_uri=saved["mlflow"]["location"])
    assert len(client.search_runs([client.get_experiment_by_name("exp").experiment_id])) == 1
