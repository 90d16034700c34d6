"""A tracker that stops answering: waited for once within the bound, then not until it has caught up; its metric
records wait in bounded memory (the oldest dropped first, counted; events never); the end waits a bounded time
and counts what was not delivered. The backend is a real one whose calls block on an event the test controls."""

from __future__ import annotations

import json
import threading
import warnings
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from automodel_ckpt.errors import ConfigError
from automodel_ckpt.ondisk import layout
from automodel_ckpt.tracking import lane as lane_module
from automodel_ckpt.tracking import tracker as tracker_module
from automodel_ckpt.tracking.base import Backend
from automodel_ckpt.tracking.costlog import iter_events
from automodel_ckpt.tracking.observer import RunObserver
from automodel_ckpt.tracking.tracker import RunTracker


class GatedBackend(Backend):
    """Keeps what it is sent; every metrics call first waits until ``gate`` is open (``entered`` is set then)."""

    name, module, extra = "tensorboard", "json", "tensorboard"
    acknowledged = True
    gate = threading.Event()
    entered = threading.Event()
    last: GatedBackend | None = None

    def __init__(self, section) -> None:
        super().__init__(section)
        self.steps: list[int] = []
        self.events: list[tuple[str, int]] = []
        self.flushes = 0
        self.closed: str | None = None
        GatedBackend.last = self

    def open(self, ctx):
        return {"run_id": "gated"}

    def log_metrics(self, metrics, step):
        GatedBackend.entered.set()
        GatedBackend.gate.wait()
        self.steps.append(step)

    def log_event(self, kind, text, step):
        self.events.append((kind, step))

    def flush(self):
        self.flushes += 1

    def close(self, status):
        self.closed = status


@pytest.fixture
def gated(monkeypatch):
    monkeypatch.setattr(tracker_module, "BACKENDS", (GatedBackend,))
    GatedBackend.gate = threading.Event()
    GatedBackend.entered = threading.Event()
    yield GatedBackend
    GatedBackend.gate.set()  # no thread stays blocked after the test


def _section():
    return OmegaConf.create({"tensorboard": {}, "mlflow": None, "wandb": None})


def _messages(caught, text: str) -> list[str]:
    return [str(w.message) for w in caught if text in str(w.message)]


def test_a_tracker_that_stops_answering_is_waited_for_once_then_not_until_it_caught_up(tmp_path, gated):
    records: list[dict] = []
    tracker = RunTracker(_section(), tmp_path, enabled=True, hparams=dict, record=records.append)
    tracker.start(0, resumed=False, events=[])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tracker.log({"train/loss": 1.0}, 1)
        assert gated.entered.wait(30)  # the backend is inside its first call, and stays there
        saved = tracker.state_dict()  # a checkpoint: waits the (short) bound once, then goes on
        assert saved["tensorboard"]["confirmed_step"] == 0  # nothing was delivered: nothing is confirmed
        for step in (2, 3):
            tracker.log({"train/loss": float(step)}, step)
            tracker.state_dict()  # behind: no wait, and no further flush queued
        assert len(_messages(caught, "logging.tensorboard is behind")) == 1
        assert [r["event"] for r in records] == ["tracking_behind"] and records[0]["step"] == 1
        gated.gate.set()  # the tracker answers again
        assert tracker.close("complete", timeout=30) == 0  # everything delivered in the end
    backend = gated.last
    assert backend.steps == [1, 2, 3] and backend.flushes == 1 and backend.closed == "complete"
    assert len(_messages(caught, "logging.tensorboard caught up after")) == 1
    assert not _messages(caught, "not delivered")
    assert [r["event"] for r in records] == ["tracking_behind", "tracking_caught_up"]
    assert records[1]["behind_s"] >= 0 and records[1]["time"] >= records[0]["time"]


def test_a_full_queue_drops_the_oldest_metrics_never_the_events_and_the_end_counts_them(tmp_path, gated,
                                                                                         monkeypatch):
    monkeypatch.setattr(lane_module, "MAX_QUEUED_METRICS", 3)
    tracker = RunTracker(_section(), tmp_path, enabled=True, hparams=dict)
    tracker.start(0, resumed=False, events=[])
    tracker.log({"train/loss": 1.0}, 1)
    assert gated.entered.wait(30)  # step 1 is in the backend's hands; the others queue
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2, 8):
            tracker.log({"train/loss": float(step)}, step)
            tracker.event("side_failure.export", f"at {step}", step)
    assert len(_messages(caught, "logging.tensorboard is behind by 3 metric records")) == 1  # at the first drop
    lane = tracker._lanes[0]
    assert lane.dropped == 3  # steps 2, 3, 4: the oldest metric records
    assert lane.confirmed == 0  # never past a dropped record (step 1 not delivered yet)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        undelivered = tracker.close("complete", timeout=0.01)  # the backend is still stuck in step 1
    assert undelivered == 1 + 3 + 3 + 6  # the call in flight, 3 dropped, 3 queued metrics, 6 queued events
    assert _messages(caught, f"experiment tracking: {undelivered} record(s) not delivered (logging.tensorboard ")
    gated.gate.set()
    assert lane.stop(30)  # let it drain (the process would have exited instead): what it got
    assert gated.last.steps == [1, 5, 6, 7] and [s for _, s in gated.last.events] == list(range(2, 8))
    assert lane.confirmed == 1  # step 2 was dropped: a checkpoint may count step 1 only


def test_a_failed_tracker_keeps_its_run_id_and_the_step_it_had_delivered(tmp_path, monkeypatch):
    class FailsAtThree(GatedBackend):
        def log_metrics(self, metrics, step):
            if step == 3:
                raise ConnectionError("server went away")
            self.steps.append(step)

    monkeypatch.setattr(tracker_module, "BACKENDS", (FailsAtThree,))
    records: list[dict] = []
    tracker = RunTracker(_section(), tmp_path, enabled=True, hparams=dict, record=records.append)
    tracker.start(0, resumed=False, events=[])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, 6):
            tracker.log({"train/loss": float(step)}, step)
        saved = tracker.state_dict()
        tracker.log({"train/loss": 6.0}, 6)
        assert tracker.close("complete", timeout=30) == 4  # step 3 failed; 4, 5 and 6 were never sent
    assert saved == {"tensorboard": {"run_id": "gated", "location": str(tmp_path.resolve()), "confirmed_step": 2}}
    assert len(_messages(caught, "logging.tensorboard failed (ConnectionError: server went away)")) == 1
    assert [r["event"] for r in records] == ["tracking_behind"] and records[0]["failed"]


def test_side_failures_are_recorded_sent_and_counted_in_the_report(tmp_path, gated):
    gated.gate.set()
    observer = RunObserver(_section(), tmp_path, is_main=True, config_yaml="seed: 1\n")
    observer.start(0, None)
    observer.side_failure("export", "the export of epoch_0_step_2 failed (disk full)", 2)
    observer.side_failure("local_step", "warning: node-local step epoch_0_step_3 abandoned: disk full", 3)
    observer.side_failure("local_step", "warning: node-local step epoch_0_step_4 abandoned: disk full", 4)
    observer.side_failure("local_step", "node-local steps are written again: epoch_0_step_6 (after 2 failed)", 6)
    observer.costs.save(lambda: None, 4, lambda: None)  # one checkpoint: the end line is printed
    line = observer.end(4, "complete")
    failures = [r for r in list(iter_events(tmp_path)) if r["event"] == "side_failure"]
    assert [(r["kind"], r["at_step"]) for r in failures] == [("export", 2), ("local_step", 3), ("local_step", 4),
                                                             ("local_step", 6)]
    assert failures[0]["text"] == "the export of epoch_0_step_2 failed (disk full)"
    assert observer.side_failures == {"export": 1, "local_step": 3}
    assert ("side_failure.export", 2) in gated.last.events and ("side_failure.local_step", 4) in gated.last.events
    assert "; 2 local step(s) abandoned; 1 side failure(s)" in line  # steps written again: no failure


def test_the_report_says_how_long_tracking_was_behind(tmp_path):
    from automodel_ckpt.tracking.costlog import summarize
    from automodel_ckpt.tracking.costreport import cost_report, one_line, render

    events = [
        {"event": "start", "time": 0.0, "step": 0},
        {"event": "tracking_behind", "time": 10.0, "step": 5, "backend": "mlflow"},
        {"event": "tracking_behind", "time": 12.0, "step": 6, "backend": "tensorboard"},
        {"event": "checkpoint", "time": 14.0, "step": 10, "at_step": 10, "blocked_s": 0.5},
        {"event": "tracking_caught_up", "time": 15.0, "step": 10, "backend": "mlflow", "behind_s": 5.0},
        {"event": "tracking_caught_up", "time": 16.0, "step": 10, "backend": "tensorboard", "behind_s": 4.0},
        {"event": "end", "time": 20.0, "step": 20, "status": "complete"},
        {"event": "start", "time": 100.0, "step": 20},  # a second launch: behind (failed) to its end
        {"event": "tracking_behind", "time": 101.0, "step": 21, "backend": "mlflow", "failed": True},
        {"event": "side_failure", "time": 102.0, "kind": "local_step", "text": "local step 22 abandoned: full",
         "at_step": 22},
        {"event": "end", "time": 104.0, "step": 24, "status": "complete"},
    ]
    report = cost_report(summarize(events))
    assert report["tracking_behind_s"] == 6.0 + 3.0  # 10-16 (union of both trackers), then 101-104
    assert report["local_steps_abandoned"] == 1 and report["side_failures"] == 1
    assert "; tracking behind 9.00 s; 1 local step(s) abandoned" in one_line(report)
    text = render(report)
    assert "tracking behind:            9.00 s" in text and "local steps abandoned:      1" in text
    (tmp_path / layout.EVENTS_LOG).write_text("".join(json.dumps(e) + "\n" for e in events))
    assert cost_report(summarize(list(iter_events(tmp_path))))["tracking_behind_s"] == 9.0


def test_the_end_waits_as_long_as_logging_close_timeout_s_and_refuses_a_bound_out_of_range(tmp_path):
    section = OmegaConf.create({"tensorboard": {}, "close_timeout_s": 25})
    assert RunTracker(section, tmp_path, enabled=False, hparams=dict).close_timeout == 25.0
    assert RunTracker(_section(), tmp_path, enabled=False, hparams=dict).close_timeout == tracker_module.CLOSE_TIMEOUT_S
    for bad in (0, -1, 61):
        with pytest.raises(ConfigError, match="logging.close_timeout_s must be in"):
            RunTracker(OmegaConf.create({"close_timeout_s": bad}), tmp_path, enabled=False, hparams=dict)


class _SteadyLane:
    """A lane that finishes one call at every look and ends after ``calls``: a replay that keeps making progress."""

    def __init__(self, calls: int) -> None:
        self.calls, self.calls_done = calls, 0

    def join(self, timeout: float) -> bool:
        if timeout > 0 and self.calls_done < self.calls:
            self.calls_done += 1
        return self.calls_done >= self.calls


def test_the_end_waits_for_a_tracker_that_keeps_making_progress_however_long_it_takes(monkeypatch):
    clock = iter(range(0, 10**6, 10))  # every look at the clock is 10 s later: 40 calls take 400 s
    monkeypatch.setattr(tracker_module.time, "monotonic", lambda: next(clock))
    lane = _SteadyLane(40)
    RunTracker._wait_for_progress([lane], idle=30.0)
    assert lane.calls_done == 40  # delivered to the end, far past CLOSE_MAX_S; no call took longer than 30 s
    stuck = _SteadyLane(40)
    stuck.join = lambda timeout: False  # no call ever finishes: the end gives up after ``idle``
    RunTracker._wait_for_progress([stuck], idle=30.0)
    assert stuck.calls_done == 0
