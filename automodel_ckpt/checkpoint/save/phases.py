"""How long a save took, phase by phase (``Checkpointer.last_save_seconds``), and how long training has run."""

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


class TrainingTime:
    """Seconds of training a checkpoint records: this run's so far plus what the restored checkpoint recorded."""

    def __init__(self) -> None:
        self.before = 0.0  # recorded in the restored checkpoint (0 for a fresh run)
        self.started = time.monotonic()

    def restart(self, before: float) -> None:
        """A checkpoint was loaded: its ``before`` seconds carry over, this run's count from now."""
        self.before = before
        self.started = time.monotonic()

    def seconds(self) -> float:
        return self.before + time.monotonic() - self.started
