"""The run's experiment trackers behind one object: logs off the training thread, its run ids saved in checkpoints.

A resume reopens the same tracked runs and replays from the run's own logs what a backend lacks. Only rank 0 logs,
each backend on its own thread; a failing backend is a warning and is dropped (docs/tracking.md).
"""

from __future__ import annotations

import functools
import re
import time
import warnings
from pathlib import Path
from typing import Any, Callable

from automodel_ckpt.errors import ConfigError
from automodel_ckpt.ondisk import RunFolder
from automodel_ckpt.tracking.base import Backend, OpenContext, require_installed
from automodel_ckpt.tracking.costlog import BEHIND, finite_number
from automodel_ckpt.tracking.lane import EVENT, METRICS, Lane
from automodel_ckpt.tracking.mlflow_backend import MLflowBackend
from automodel_ckpt.tracking.tensorboard_backend import TensorBoardBackend
from automodel_ckpt.tracking.wandb_backend import WandbBackend
from automodel_ckpt.training.metrics import read_jsonl


BACKENDS: tuple[type[Backend], ...] = (TensorBoardBackend, MLflowBackend, WandbBackend)
FLUSH_TIMEOUT_S = 2.0  # how long a checkpoint waits for a tracker to catch up (then it is behind: not waited for)
CLOSE_TIMEOUT_S = 10.0  # how long the end of a launch waits for a tracker that makes no progress (then gives up);
# ``logging.close_timeout_s`` sets it
CLOSE_MAX_S = 60.0  # the largest ``logging.close_timeout_s``
SKIPPED = ("step", "epoch", "sample_ids")  # record keys that are no metric
RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # a tracked run's id as the trackers make them (MLflow: 32 hex)


def train_metrics(record: dict[str, Any]) -> dict[str, float]:
    """``training.jsonl`` record -> ``train/<key>`` scalars."""
    return {f"train/{k}": float(v) for k, v in record.items() if k not in SKIPPED and finite_number(v) is not None}


def validation_metrics(record: dict[str, Any]) -> dict[str, float]:
    """``validation.jsonl`` record -> ``val/<key>`` scalars; an evaluation's ``eval/...`` keeps its name."""
    return {(k if k.startswith("eval/") else f"val/{k.removeprefix('val_')}"): float(v) for k, v in record.items()
            if k not in SKIPPED and finite_number(v) is not None}


def checkpoint_metrics(record: dict[str, Any]) -> dict[str, float]:
    """``events.jsonl`` checkpoint record -> ``checkpoint/<key>`` scalars."""
    keys = ("blocked_s", "background_s", "bytes", "write_gbps", "wall_share")
    return {f"checkpoint/{k}": float(record[k]) for k in keys if finite_number(record.get(k)) is not None}


class RunTracker:
    """The trackers named under ``logging:`` (none: every call is a no-op)."""

    def __init__(self, section: Any, run_dir: Path, *, enabled: bool, hparams: Callable[[], dict[str, Any]],
                 record: Callable[[dict[str, Any]], None] | None = None) -> None:
        chosen = [b for b in BACKENDS if section is not None and section.get(b.name) is not None]
        for backend in chosen:  # every rank: the same one-line error before training
            require_installed(backend)
        self.requested = bool(chosen)  # on every rank: the state is saved whenever a backend is configured
        self.run_dir = Path(run_dir)
        self.backends: list[Backend] = [b(section.get(b.name)) for b in chosen] if enabled else []
        self._hparams = hparams
        self._saved: dict[str, Any] = {}
        self._lanes: list[Lane] = []  # one thread per backend, from ``start``
        self._record = record or (lambda _record: None)  # BEHIND / CAUGHT_UP records, on the training thread
        self._step = 0  # the last step logged (the step of a BEHIND record)
        timeout = section.get("close_timeout_s") if section is not None else None
        self.close_timeout = float(timeout) if timeout is not None else CLOSE_TIMEOUT_S
        if not 0 < self.close_timeout <= CLOSE_MAX_S:
            raise ConfigError(f"logging.close_timeout_s must be in (0, {CLOSE_MAX_S:.0f}] seconds, not {timeout}")

    @property
    def active(self) -> bool:
        return bool(self.backends)

    # --- recipe state ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Each backend's run id and last durable step, after a bounded wait; a failed one keeps what it confirmed."""
        self.flush()
        return {lane.backend.name: {**lane.state, "location": lane.location,
                                    "confirmed_step": lane.confirmed if lane.backend.durable else 0}
                for lane in self._lanes if lane.state}

    def flush(self, timeout: float = FLUSH_TIMEOUT_S) -> None:
        """Wait at most ``timeout`` for the durable backends; one not done is behind: one warning, not waited for."""
        self._notes()
        began = time.time()
        waiting = []
        for lane in self._lanes:
            if lane.backend.durable and not lane.failed and lane.behind_since is None:
                lane.put(functools.partial(self._flush, lane))
                waiting.append((lane, lane.marker()))
        deadline = time.monotonic() + timeout
        for lane, done in waiting:
            if not done.wait(max(0.0, deadline - time.monotonic())) and lane.mark_behind(began):
                self._record({"event": BEHIND, "time": began, "step": self._step, "backend": lane.backend.name,
                              "waited_s": timeout})
                opening = "" if lane.opened else ", still opening its run"
                warnings.warn(f"logging.{lane.backend.name} is behind (nothing back within {timeout:.0f} s{opening}); "
                              "training goes on without waiting for it (a resume replays what it lacks)",
                              stacklevel=3)

    @staticmethod
    def _flush(lane: Lane) -> None:
        step = lane.delivered
        lane.backend.flush()
        lane.durable = max(lane.durable, step)

    def _notes(self, lanes: list[Lane] | None = None) -> None:
        """Record what the lanes noted (caught up, failed) in the run's events, on the training thread."""
        for lane in self._lanes if lanes is None else lanes:
            while lane.notes:
                note = lane.notes.popleft()
                if note["event"] == "tracking_failed":  # behind for the rest of the launch
                    note = {"event": BEHIND, "time": note["time"], "step": self._step, "backend": lane.backend.name,
                            "failed": True}
                self._record({**note, "step": self._step} if "step" not in note else note)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._saved = dict(state) if isinstance(state, dict) else {}  # checked per backend by ``_reusable``

    # --- a launch -------------------------------------------------------------------------------
    def start(self, step: int, *, resumed: bool, events: list[tuple[str, str]]) -> None:
        """Open every backend (same tracked run when ``resumed``), replay up to ``step``, log ``events``."""
        if not self.active:
            return
        hparams = self._hparams()
        for backend in self.backends:
            location = backend.location(self.run_dir, self.run_dir.name)
            saved = self._reusable(backend, location, step) if resumed else {}
            lane = Lane(backend)
            lane.location = location
            lane.state = backend.initial_state(saved)  # known now: e.g. the W&B run id it will open
            if saved.get("run_id") and backend.durable:  # kept if the open fails: a later resume reopens it
                lane.state = {"run_id": saved["run_id"], **lane.state}
            lane.durable = lane.delivered = int(saved.get("confirmed_step") or 0)
            ctx = OpenContext(self.run_dir, self.run_dir.name, location, hparams, {**saved, **lane.state},
                              step if resumed else None, int(saved.get("confirmed_step") or 0))
            lane.put(lambda lane=lane, ctx=ctx: self._open(lane, ctx))
            self._lanes.append(lane)
        for kind, text in events:
            self.event(kind, text, step)

    def _reusable(self, backend: Backend, location: str, step: int) -> dict[str, Any]:
        """``backend``'s restored state if saved for this ``location``; else nothing, one warning, a new run."""
        saved = self._saved.get(backend.name)
        if not isinstance(saved, dict) or not saved:
            return {}
        where = saved.get("location", saved.get(backend.legacy_location_key) if backend.legacy_location_key else None)
        run_id, confirmed, key = saved.get("run_id"), saved.get("confirmed_step", 0), saved.get("run_key")
        if not backend.same_location(where, location):
            why = "was kept elsewhere"
        elif any(v is not None and not (isinstance(v, str) and RUN_ID.fullmatch(v)) for v in (run_id, key)):
            why = "has no valid run id"
        elif not (type(confirmed) is int and 0 <= confirmed <= step):
            why = "has no valid confirmed step"
        else:
            return {k: v for k, v in (("run_id", run_id), ("run_key", key), ("confirmed_step", confirmed))
                    if v is not None}
        warnings.warn(f"logging.{backend.name}: the restored checkpoint's tracked run {why}; starting a new "
                      f"tracked run at {location} (the run's history up to step {step} is replayed into it)",
                      stacklevel=3)
        return {}

    def _open(self, lane: Lane, ctx: OpenContext) -> None:
        lane.state = lane.backend.open(ctx)
        lane.opened = True
        if ctx.resume_step is None:
            return
        first = lane.backend.first_replay_step(ctx.confirmed_step)
        for step, metrics in self._history(first, ctx.resume_step):
            lane.backend.log_metrics(metrics, step)
            lane.delivered_step(step)

    def _history(self, first: int, last: int) -> list[tuple[int, dict[str, float]]]:
        """The run's logged metrics of steps ``first..last`` from its logs, merged by step."""
        rows: dict[int, dict[str, float]] = {}
        run = RunFolder(self.run_dir)
        for log, convert in ((run.training_log, train_metrics), (run.validation_log, validation_metrics)):
            for record in read_jsonl(log):
                step = record.get("step")
                if isinstance(step, int) and first <= step <= last:
                    rows.setdefault(step, {}).update(convert(record))
        for record in read_jsonl(run.events_log):  # the last record of a step wins
            step = record.get("at_step", record.get("step"))
            if record.get("event") == "checkpoint" and isinstance(step, int) and first <= step <= last:
                rows.setdefault(step, {}).update(checkpoint_metrics(record))
        return sorted(rows.items())

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Queue ``metrics`` of ``step`` for every backend; returns at once."""
        self._step = max(self._step, step)
        self._notes()
        if metrics:
            for lane in self._lanes:
                lane.put(functools.partial(self._log, lane, metrics, step), METRICS, step)

    @staticmethod
    def _log(lane: Lane, metrics: dict[str, float], step: int) -> None:
        lane.backend.log_metrics(metrics, step)
        lane.delivered_step(step)

    def event(self, kind: str, text: str, step: int) -> None:
        """An event (``resume``, ``fallback``, ``preemption``, ``end``...) as text at ``step``; never dropped."""
        for lane in self._lanes:
            lane.put(functools.partial(lane.backend.log_event, kind, text, step), EVENT, step)

    @staticmethod
    def _wait_for_progress(lanes: list[Lane], idle: float) -> None:
        """Wait until every lane ended, giving up once none finished a call for ``idle`` seconds."""
        last, progressed = -1, time.monotonic()
        while True:
            alive = [lane for lane in lanes if not lane.join(0.0)]
            done = sum(lane.calls_done for lane in lanes)
            now = time.monotonic()
            if done != last:
                last, progressed = done, now
            left = progressed + idle - now
            if not alive or left <= 0:
                return
            alive[0].join(min(left, 0.1))

    def close(self, status: str, timeout: float | None = None) -> int:
        """End of the launch: flush and close every backend (``timeout`` without progress); records undelivered."""
        timeout = self.close_timeout if timeout is None else timeout
        self._notes()
        lanes, self._lanes = self._lanes, []
        for lane in lanes:
            if not lane.failed:
                lane.put(functools.partial(lane.backend.close, status))
        for lane in lanes:
            lane.stop()
        self._wait_for_progress(lanes, timeout)
        self._notes(lanes)
        lost = {lane.backend.name: lane.undelivered() for lane in lanes}
        total = sum(lost.values())
        if total:
            which = ", ".join(f"logging.{name} {n}" for name, n in lost.items() if n)
            warnings.warn(f"experiment tracking: {total} record(s) not delivered ({which}); the run's own logs "
                          "(training.jsonl, validation.jsonl, events.jsonl) have them, and a resume replays what the "
                          "tracker lacks up to its checkpoint", stacklevel=3)
        return total
