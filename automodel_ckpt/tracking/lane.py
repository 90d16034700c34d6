"""One tracker's own background thread: its calls run in order, off the training thread; a failure drops it."""

from __future__ import annotations

import queue
import threading
import warnings
from typing import Any, Callable

from automodel_ckpt.errors import first_line
from automodel_ckpt.tracking.base import Backend


class Lane:
    """The queue and thread of one backend. ``state``: what reopens its tracked run; ``logged``: the last step it
    accepted. A call that raises is one warning; the backend's later calls are skipped (markers still pass)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.state: dict[str, Any] = {}
        self.location = ""  # where the backend writes (saved beside ``state``)
        self.logged = 0
        self.failed = False
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._work, name=f"tracking-{backend.name}", daemon=True)
        self._thread.start()

    def put(self, job: Callable[[], Any]) -> None:
        self._queue.put((False, job))

    def marker(self) -> threading.Event:
        """An event set once everything queued before it has run (or been skipped)."""
        done = threading.Event()
        self._queue.put((True, done.set))
        return done

    def stop(self) -> None:
        self._queue.put(None)

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            always, job = item
            if self.failed and not always:
                continue
            try:
                job()
            except Exception as exc:  # noqa: BLE001 - a tracker never stops training
                self.failed = True
                warnings.warn(f"logging.{self.backend.name} failed ({type(exc).__name__}: {first_line(exc)}); it stops "
                              "logging for this launch, training goes on", stacklevel=2)
