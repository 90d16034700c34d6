"""How long each phase of a save took: ``Checkpointer.last_save_seconds`` and ``last_complete_seconds``."""

from __future__ import annotations

import time


class PhaseClock:
    """Seconds spent per phase of a save (``Checkpointer.last_save_seconds``, read by tools/bench_async.py)."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = round(now - self._last, 4)
        self._last = now
