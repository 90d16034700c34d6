"""One tracker's own background thread: its calls run in order, off the training thread, in bounded memory."""

from __future__ import annotations

import collections
import threading
import time
import warnings
from typing import Any, Callable

from automodel_ckpt.errors import first_line
from automodel_ckpt.tracking.base import Backend
from automodel_ckpt.tracking.costlog import CAUGHT_UP

MAX_QUEUED_METRICS = 10_000  # metric records a lane holds for a tracker that is behind; then the oldest are dropped
METRICS, EVENT, CONTROL = "metrics", "event", "control"  # what a queued call carries (only METRICS are dropped)


class Lane:
    """The queue and thread of one backend. ``confirmed``: what a checkpoint may record (never past a dropped record);
    a call that raises is one warning and skips the later ones; past ``max_metrics`` the oldest metrics go."""

    def __init__(self, backend: Backend, *, max_metrics: int | None = None) -> None:
        self.backend = backend
        self.state: dict[str, Any] = {}
        self.location = ""  # where the backend writes (saved beside ``state``)
        self.delivered = 0
        self.durable = 0
        self.opened = False  # the backend's ``open`` returned
        self.failed = False
        self.dropped = 0  # metric records dropped unsent (the queue was full)
        self.skipped = 0  # metric records and events not sent because the backend had failed
        self.behind_since: float | None = None  # when the training thread stopped waiting for it
        self.notes: collections.deque[dict[str, Any]] = collections.deque()  # caught up / failed, for the owner
        self._first_dropped: int | None = None
        self._max_metrics = max_metrics or MAX_QUEUED_METRICS
        self._items: collections.deque[tuple[str, int | None, Callable[[], Any]] | None] = collections.deque()
        self._metrics = 0  # METRICS items in ``_items``
        self._running: str | None = None  # the kind of the call running now
        self.calls_done = 0  # calls that ended (a sign of progress for whoever waits)
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._work, name=f"tracking-{backend.name}", daemon=True)
        self._thread.start()

    @property
    def confirmed(self) -> int:
        """The last step up to which every metric record reached the backend durably."""
        step = self.durable
        return step if self._first_dropped is None else min(step, self._first_dropped - 1)

    def delivered_step(self, step: int) -> None:
        """Called on the lane's thread once the backend accepted the metrics of ``step``."""
        self.delivered = max(self.delivered, step)
        if self.backend.acknowledged:
            self.durable = self.delivered

    def put(self, job: Callable[[], Any], kind: str = CONTROL, step: int | None = None) -> None:
        """Queue ``job``; returns at once. A full queue drops its oldest metric record (counted)."""
        with self._cond:
            if self.failed and kind != CONTROL:
                self.skipped += 1
                return
            full = kind == METRICS and self._metrics >= self._max_metrics
            if full:
                self._drop_oldest()
            if kind == METRICS:
                self._metrics += 1
            self._items.append((kind, step, job))
            self._cond.notify()
        if full and self.dropped == 1:
            warnings.warn(f"logging.{self.backend.name} is behind by {self._max_metrics} metric records; the oldest "
                          "are dropped from now on (counted at the end; a resume replays them)", stacklevel=3)

    def marker(self) -> threading.Event:
        """An event set once everything queued before it has run (or been skipped)."""
        done = threading.Event()
        self.put(done.set)
        return done

    def stop(self, timeout: float = 0.0) -> bool:
        """Let the thread end once its queue has run, waiting at most ``timeout``; whether it ended."""
        with self._cond:
            self._items.append(None)
            self._cond.notify()
        return self.join(timeout)

    def join(self, timeout: float) -> bool:
        """Wait at most ``timeout`` for the thread to end (after ``stop``); whether it ended."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def mark_behind(self, since: float) -> bool:
        """Training stops waiting for this backend: whether it is behind now (False: caught up meanwhile)."""
        with self._cond:
            if not self._items and self._running is None:
                return False
            if self.behind_since is None:
                self.behind_since = since
            return True

    def undelivered(self) -> int:
        """Metric records and events not sent: dropped, skipped after a failure, or still queued or running."""
        with self._cond:
            waiting = sum(1 for item in self._items if item is not None and item[0] != CONTROL)
            busy = self._running not in (None, CONTROL) and self._thread.is_alive()
            return self.dropped + self.skipped + waiting + (1 if busy else 0)

    def _drop_oldest(self) -> None:
        for i, item in enumerate(self._items):
            if item is not None and item[0] == METRICS:
                del self._items[i]
                self._metrics -= 1
                self.dropped += 1
                if item[1] is not None:
                    first = self._first_dropped
                    self._first_dropped = item[1] if first is None else min(first, item[1])
                return

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._items:
                    self._cond.wait()
                item = self._items.popleft()
                if item is None:
                    return
                kind, _, job = item
                if kind == METRICS:
                    self._metrics -= 1
                skip = self.failed and kind != CONTROL
                if skip:
                    self.skipped += 1
                self._running = None if skip else kind
            if not skip:
                self._run(job, kind)
            with self._cond:
                self._running = None
                self.calls_done += 1
                idle = all(item is None for item in self._items)  # nothing left but the end of the thread
                caught_up = self.behind_since is not None and idle and not self.failed
                seconds = self._caught_up() if caught_up else 0.0
            if caught_up:
                warnings.warn(f"logging.{self.backend.name} caught up after {seconds:.1f} s behind", stacklevel=2)

    def _run(self, job: Callable[[], Any], kind: str) -> None:
        try:
            job()
        except Exception as exc:  # noqa: BLE001 - a tracker never stops training
            with self._cond:
                self.failed = True
                self.skipped += kind != CONTROL  # the record of the call that failed was not delivered either
                self.notes.append({"event": "tracking_failed", "time": time.time(), "backend": self.backend.name})
            warnings.warn(f"logging.{self.backend.name} failed ({type(exc).__name__}: {first_line(exc)}); it stops "
                          "logging for this launch, training goes on (a resume replays what it lacks)", stacklevel=2)

    def _caught_up(self) -> float:
        """With ``_cond`` held: the backend has run everything queued while it was behind; the seconds behind."""
        since, self.behind_since = self.behind_since, None
        now = time.time()
        seconds = now - (since or now)
        self.notes.append({"event": CAUGHT_UP, "time": now, "backend": self.backend.name,
                           "behind_s": round(seconds, 3)})
        return seconds
