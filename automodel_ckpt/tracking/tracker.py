"""The run's experiment trackers behind one object: logs off the training thread, its run ids saved in checkpoints.

``RunTracker`` is recipe state (it has ``state_dict``/``load_state_dict``, so every checkpoint saves it): the state
is each backend's run id and the last step it had made durable. A resume restores it before ``start``, which reopens
the same tracked runs and replays from the run's own logs (``training.jsonl``, ``validation.jsonl``,
``events.jsonl``, already cut back to the restored step) whatever a backend may lack up to that step. Only rank 0
logs. Every backend call runs on one background thread, in order; a failing backend is a warning and is dropped,
training goes on.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import warnings
from pathlib import Path
from typing import Any, Callable

from automodel_ckpt.checkpoint import layout
from automodel_ckpt.errors import first_line
from automodel_ckpt.tracking.base import Backend, OpenContext, require_installed
from automodel_ckpt.tracking.mlflow_backend import MLflowBackend
from automodel_ckpt.tracking.tensorboard_backend import TensorBoardBackend
from automodel_ckpt.tracking.wandb_backend import WandbBackend
from automodel_ckpt.training.metrics import read_jsonl

logger = logging.getLogger(__name__)

BACKENDS: tuple[type[Backend], ...] = (TensorBoardBackend, MLflowBackend, WandbBackend)
FLUSH_TIMEOUT_S = 60.0  # how long a checkpoint waits for the trackers to catch up (then the resume replays)
SKIPPED = ("step", "epoch", "sample_ids")  # record keys that are no metric


def train_metrics(record: dict[str, Any]) -> dict[str, float]:
    """``training.jsonl`` record -> ``train/<key>`` scalars."""
    return {f"train/{k}": float(v) for k, v in record.items() if k not in SKIPPED and _number(v)}


def validation_metrics(record: dict[str, Any]) -> dict[str, float]:
    """``validation.jsonl`` record -> ``val/<key>`` scalars (``val_loss`` -> ``val/loss``)."""
    return {f"val/{k.removeprefix('val_')}": float(v) for k, v in record.items() if k not in SKIPPED and _number(v)}


def checkpoint_metrics(record: dict[str, Any]) -> dict[str, float]:
    """``events.jsonl`` checkpoint record -> ``checkpoint/<key>`` scalars."""
    keys = ("blocked_s", "background_s", "bytes", "write_gbps", "wall_share")
    return {f"checkpoint/{k}": float(record[k]) for k in keys if _number(record.get(k))}


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class RunTracker:
    """The trackers named under ``logging:`` (none: every call is a no-op)."""

    def __init__(self, section: Any, run_dir: Path, *, enabled: bool, hparams: Callable[[], dict[str, Any]]) -> None:
        chosen = [b for b in BACKENDS if section is not None and section.get(b.name) is not None]
        for backend in chosen:  # every rank: the same one-line error before training
            require_installed(backend)
        self.requested = bool(chosen)  # on every rank: the state is saved whenever a backend is configured
        self.run_dir = Path(run_dir)
        self.backends: list[Backend] = [b(section.get(b.name)) for b in chosen] if enabled else []
        self._hparams = hparams
        self._saved: dict[str, Any] = {}
        self._states: dict[str, dict[str, Any]] = {}
        self._logged: dict[str, int] = {}  # backend -> last step whose metrics it accepted
        self._dropped: set[str] = set()  # backends that failed: skipped for the rest of the launch
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None

    @property
    def active(self) -> bool:
        return bool(self.backends)

    # --- recipe state ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Each backend's run id and last durable step; waits (bounded) for the trackers to catch up first."""
        self.flush()
        return {b.name: {**self._states[b.name], "confirmed_step": self._logged.get(b.name, 0) if b.durable else 0}
                for b in self.backends if b.name in self._states and b.name not in self._dropped}

    def flush(self, timeout: float = FLUSH_TIMEOUT_S) -> None:
        """Wait (bounded) until every backend has logged and flushed what was queued so far."""
        if self.active and self._thread is not None:
            for backend in self.backends:
                self._call(backend, "flush")
            self.wait(timeout)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._saved = dict(state or {})

    # --- a launch -------------------------------------------------------------------------------
    def start(self, step: int, *, resumed: bool, events: list[tuple[str, str]]) -> None:
        """Open every backend (same tracked run when ``resumed``), replay up to ``step``, log ``events``."""
        if not self.active:
            return
        self._thread = threading.Thread(target=self._work, name="tracking", daemon=True)
        self._thread.start()
        hparams = self._hparams()
        for backend in list(self.backends):
            saved = dict(self._saved.get(backend.name) or {}) if resumed else {}
            ctx = OpenContext(self.run_dir, self.run_dir.name, hparams, saved, step if resumed else None,
                              int(saved.get("confirmed_step") or 0))
            self._queue.put((backend, lambda b=backend, c=ctx: self._open(b, c)))
        for kind, text in events:
            self.event(kind, text, step)

    def _open(self, backend: Backend, ctx: OpenContext) -> None:
        self._states[backend.name] = backend.open(ctx)
        if ctx.resume_step is None:
            return
        first = backend.first_replay_step(ctx.confirmed_step)
        for step, metrics in self._history(first, ctx.resume_step):
            backend.log_metrics(metrics, step)
            self._logged[backend.name] = step

    def _history(self, first: int, last: int) -> list[tuple[int, dict[str, float]]]:
        """The run's logged metrics of steps ``first..last`` from its logs, merged by step."""
        rows: dict[int, dict[str, float]] = {}
        sources = ((layout.TRAINING_LOG, train_metrics), (layout.VALIDATION_LOG, validation_metrics))
        for name, convert in sources:
            for record in read_jsonl(self.run_dir / name):
                step = record.get("step")
                if isinstance(step, int) and first <= step <= last:
                    rows.setdefault(step, {}).update(convert(record))
        for record in read_jsonl(self.run_dir / layout.EVENTS_LOG):  # the last record of a step wins
            step = record.get("at_step", record.get("step"))
            if record.get("event") == "checkpoint" and isinstance(step, int) and first <= step <= last:
                rows.setdefault(step, {}).update(checkpoint_metrics(record))
        return sorted(rows.items())

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Queue ``metrics`` of ``step`` for every backend; returns at once."""
        if self.active and metrics:
            for backend in self.backends:
                self._call(backend, "log_metrics", metrics, step)

    def event(self, kind: str, text: str, step: int) -> None:
        """An event (``resume``, ``fallback``, ``preemption``, ``end``...) as text at ``step``."""
        for backend in self.backends:
            self._call(backend, "log_event", kind, text, step)

    def close(self, status: str, timeout: float = FLUSH_TIMEOUT_S) -> None:
        """End of the launch: flush and close every backend (``status``: complete, preempted, failed)."""
        if not self.active or self._thread is None:
            return
        for backend in self.backends:
            self._call(backend, "close", status)
        self.wait(timeout)
        self._queue.put(None)
        self._thread = None

    # --- the tracking thread --------------------------------------------------------------------
    def _call(self, backend: Backend, method: str, *args: Any) -> None:
        def call() -> None:
            getattr(backend, method)(*args)
            if method == "log_metrics":
                self._logged[backend.name] = args[1]
        self._queue.put((backend, call))

    def wait(self, timeout: float) -> bool:
        """Block until everything queued so far has run (or ``timeout``); whether it has."""
        if self._thread is None:
            return True
        done = threading.Event()
        self._queue.put((None, done.set))
        if not done.wait(timeout):
            warnings.warn(f"experiment tracking is {timeout:.0f} s behind; going on (a resume replays what it lacks)",
                          stacklevel=3)
            return False
        return True

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            backend, job = item
            if backend is not None and backend.name in self._dropped:
                continue
            try:
                job()
            except Exception as exc:  # noqa: BLE001 - a tracker never stops training
                name = backend.name if backend is not None else "tracking"
                self._dropped.add(name)
                warnings.warn(f"logging.{name} failed ({type(exc).__name__}: {first_line(exc)}); it stops logging "
                              "for this launch, training goes on", stacklevel=2)
