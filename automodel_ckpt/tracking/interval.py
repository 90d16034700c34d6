"""The checkpoint interval that minimises expected lost time (Young/Daly), and the overhead at any interval.

    overhead(interval) = cost / interval  +  (interval / 2 + latency) / mtbf
    interval* = sqrt(2 * cost * mtbf)        overhead(interval*) = sqrt(2 * cost / mtbf) + latency / mtbf

``latency``: an async checkpoint counts once its background writes are complete. The assumptions (independent
failures at a constant rate, constant costs, ``cost`` much smaller than ``mtbf``) are docs/tracking.md's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


MAX_STEPS = 1 << 62  # an interval in steps is at most this (an interval of seconds over a tiny step time)


def young_daly_interval(cost_s: float, mtbf_s: float) -> float:
    """``sqrt(2 * cost * mtbf)`` seconds (``ValueError`` unless finite, cost >= 0 and mtbf > 0)."""
    if not (math.isfinite(cost_s) and math.isfinite(mtbf_s)) or cost_s < 0 or mtbf_s <= 0:
        raise ValueError(f"need finite cost >= 0 and mtbf > 0, got cost={cost_s}, mtbf={mtbf_s}")
    return math.sqrt(2.0 * cost_s) * math.sqrt(mtbf_s)  # no overflow of the product


def expected_overhead(interval_s: float, cost_s: float, mtbf_s: float, latency_s: float = 0.0) -> float:
    """Expected fraction of wall time lost to checkpoints and redone work at a checkpoint every ``interval_s``."""
    if interval_s <= 0 or mtbf_s <= 0:
        raise ValueError(f"need interval > 0 and mtbf > 0, got interval={interval_s}, mtbf={mtbf_s}")
    return cost_s / interval_s + (interval_s / 2.0 + latency_s) / mtbf_s


@dataclass(frozen=True)
class IntervalAdvice:
    """Young/Daly's interval for one run: in seconds, in steps (at least 1), and the expected overheads."""

    interval_s: float  # sqrt(2 * cost * mtbf)
    interval_steps: int  # interval_s in whole steps, at least one
    overhead: float  # at interval_steps
    current_interval_s: float | None  # the run's own interval (None: it checkpointed once or never)
    current_overhead: float | None


def advise(cost_s: float, mtbf_s: float, step_s: float, *, latency_s: float = 0.0,
           current_every_steps: float | None = None) -> IntervalAdvice:
    """The advice for checkpoints costing ``cost_s`` at ``step_s`` a step: the interval rounded to a whole step in
    ``[1, MAX_STEPS]`` and that interval's overhead; ``current_every_steps``: the run's own, for comparison."""
    if not math.isfinite(step_s) or step_s <= 0:
        raise ValueError(f"need a finite step time > 0, got {step_s}")
    ideal = young_daly_interval(cost_s, mtbf_s)
    ratio = ideal / step_s  # an infinity where the step time is tiny: the longest interval
    steps = max(1, round(ratio)) if ratio < MAX_STEPS else MAX_STEPS
    current = current_every_steps * step_s if current_every_steps else None
    return IntervalAdvice(
        interval_s=ideal, interval_steps=steps,
        overhead=expected_overhead(steps * step_s, cost_s, mtbf_s, latency_s),
        current_interval_s=current,
        current_overhead=expected_overhead(current, cost_s, mtbf_s, latency_s) if current else None,
    )
