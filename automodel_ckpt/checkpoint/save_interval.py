"""``ckpt_every_steps: auto``'s schedule (``SaveInterval``), and the bounds its numbers are checked against.

Restored from an untrusted checkpoint, a number out of range is dropped or clamped, never trained on, and said in
one line; the interval is always a whole number in ``[1, the run's last step]``.
"""

from __future__ import annotations

from typing import Any, Callable

from automodel_ckpt.ondisk.bounded import COUNT_LIMIT, is_count
from automodel_ckpt.shown import shown_value

#: seconds a save blocked training, or a step took, past which a number is no run's (some 116 days)
SECONDS_LIMIT = 1e7
#: hours of a mean time between failures past which a number is no cluster's (``checkpoint.mtbf_hours`` included)
MTBF_LIMIT_HOURS = 1e9
DEFAULT_MTBF_HOURS = 24.0  # assumed with no mtbf_hours given and no interruption in the run's cost log
MTBF_SOURCES = ("given", "observed", "assumed")


def _real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def seconds(value: object, *, positive: bool = False) -> float | None:
    """``value`` as seconds when a real number in 0 (above with ``positive``) to ``SECONDS_LIMIT``, else None."""
    if not _real(value) or not 0 <= value <= SECONDS_LIMIT or (positive and value == 0):  # NaN: never in range
        return None
    return float(value)


def mtbf_seconds(value: object) -> float | None:
    """``value`` as an MTBF in seconds when it is a real number above 0 and at most ``MTBF_LIMIT_HOURS``, else None."""
    if not _real(value) or not 0 < value <= MTBF_LIMIT_HOURS * 3600.0:  # NaN: never in range
        return None
    return float(value)


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _sample(value: object) -> list[float] | None:
    """A ``[blocked seconds, seconds a step]`` pair of a checkpoint, checked; None when it is not one."""
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        return None
    cost, step_s = seconds(value[0]), seconds(value[1], positive=True)
    return None if cost is None or step_s is None else [cost, step_s]


class SaveInterval:
    """``ckpt_every_steps: auto``: the interval, the next step that saves, and the costs and MTBF it is decided
    from (``AutoInterval``), all checkpointed with the step counters. The first save is ``min_every_steps`` in; the
    interval is clamped to ``[min_every_steps, max_every_steps]`` and ``last_step``, and counts from the last
    scheduled save (the minutes', a preemption's or the end's do not move it)."""

    SAMPLES = 8  # the last saves' costs a decision reads (their medians)

    def __init__(self, min_every: int = 1, max_every: int | None = None,
                 last_step: int | Callable[[], int] | None = None) -> None:
        self.min_every, self.max_every = max(1, int(min_every)), max_every
        self._last_step = last_step  # the run's last step, or how to read it (it may change: a run in stages)
        self.every = self.min_every if not _whole(max_every) or max_every < 1 else min(self.min_every, max_every)
        self.next_step = self.every
        self.samples: list[list[float]] = []  # [blocked seconds, seconds a step] of the last saves, every rank's MAX
        self.mtbf: list[Any] | None = None  # [seconds, "given" | "observed" | "assumed"], decided once a run
        #: what a restored schedule held out of range and which interval the run uses instead (None: nothing)
        self.restored_note: str | None = None

    @property
    def last_step(self) -> int | None:
        """The run's last step (None: no bound), read when asked."""
        return self._last_step() if callable(self._last_step) else self._last_step

    @property
    def longest(self) -> int:
        """The longest interval: ``max_every_steps``, at most the run's last step (at least 1)."""
        bounds = [b for b in (self.max_every, self.last_step) if _whole(b) and b >= 1]
        return min(bounds, default=COUNT_LIMIT)  # a step number past the largest count is no run's

    def clamp(self, every: float) -> int:
        """``every`` as a whole number in ``[min_every_steps, longest]`` (infinity: the longest; NaN: the shortest)."""
        top = self.longest
        if not _real(every) or every != every:
            every = self.min_every
        return max(1, min(int(max(self.min_every, min(every, top))), top))

    def due(self, step: int) -> bool:
        return step >= self.next_step

    def scheduled(self, step: int) -> None:
        """Step ``step`` saved: the next scheduled save is ``every`` steps on (when it was a scheduled one)."""
        if step >= self.next_step:
            self.next_step = step + self.every

    def change(self, every: float, step: int) -> bool:
        """Save every ``every`` steps (clamped) from the last scheduled save; whether the interval changed."""
        every = self.clamp(every)
        if every == self.every:
            return False
        self.next_step = max(step + 1, self.next_step - self.every + every)
        self.every = every
        return True

    def sample(self, blocked_s: float, step_s: float) -> None:
        """A save's cost and the step time then (alike on every rank); one out of range is left out."""
        checked = _sample([blocked_s, step_s])
        if checked is not None:
            self.samples = [*self.samples, checked][-self.SAMPLES:]

    def state_dict(self) -> dict[str, Any]:
        return {"every": self.every, "next_step": self.next_step, "samples": [list(s) for s in self.samples],
                "mtbf": list(self.mtbf) if self.mtbf else None}

    def load_state_dict(self, state: Any, step: int | None = None) -> None:
        """A checkpoint's schedule (untrusted) at ``step``: out-of-range numbers dropped or clamped, and said."""
        problems: list[str] = []
        last = self.last_step
        if not isinstance(state, dict):
            problems.append(f"it is a {type(state).__name__}, not a mapping")
            state = {}
        every = state.get("every")
        restored = every if is_count(every) and every >= 1 else None
        if restored is None:
            problems.append(f"'every' is {shown_value(every)}, not a whole number of steps")
        elif last and restored > last:
            problems.append(f"'every' is {restored} steps, past the run's last step {last}")
        self.every = self.clamp(restored if restored is not None else self.min_every)
        next_step = state.get("next_step")
        low, high = 1, COUNT_LIMIT  # where the run is unknown: any step ahead
        if _whole(step):  # a genuine schedule saves next within its interval from the resumed step
            low, high = step + 1, step + (restored or self.every)
            if last:
                high = min(high, max(last, step + self.every))
        if not _whole(next_step) or not low <= next_step <= high:
            problems.append(f"'next_step' is {shown_value(next_step)}, " + (
                f"outside steps {low} to {high}" if _whole(next_step) else "not a step"))
            next_step = (step if _whole(step) else 0) + self.every
        self.next_step = next_step
        self.samples = self._restored_samples(state.get("samples"), problems)
        mtbf = state.get("mtbf")
        self.mtbf = None
        if mtbf is not None:
            if isinstance(mtbf, (list, tuple)) and len(mtbf) == 2 and mtbf_seconds(mtbf[0]) is not None and \
                    isinstance(mtbf[1], str) and mtbf[1] in MTBF_SOURCES:
                self.mtbf = [float(mtbf[0]), mtbf[1]]
            else:
                problems.append(f"'mtbf' is {shown_value(mtbf)}, not [seconds above 0 to {MTBF_LIMIT_HOURS:g} h, "
                                "its source]: dropped, decided again at the next save")
        self.restored_note = None if not problems else \
            f"{'; '.join(problems)}: saves every {self.every} steps, the next at step {self.next_step}"

    def _restored_samples(self, samples: Any, problems: list[str]) -> list[list[float]]:
        """The last ``SAMPLES`` of a checkpoint's cost samples that are in range; the others said in ``problems``."""
        if samples is None:
            return []
        if not isinstance(samples, (list, tuple)):
            problems.append(f"'samples' is {shown_value(samples)}, not a list: dropped")
            return []
        kept = [s for s in map(_sample, samples[-self.SAMPLES:]) if s is not None]
        if len(kept) < len(samples):
            problems.append(f"{len(samples) - len(kept)} of its {len(samples)} cost samples dropped (it keeps "
                            f"{self.SAMPLES}, each [0 to {SECONDS_LIMIT:g} s blocked, above 0 to {SECONDS_LIMIT:g} "
                            "s a step])")
        return kept
