"""Saves that are not on the step schedule: on a preemption signal, and every ``ckpt_every_minutes``.

Both are decided at a step boundary by every rank together, with one small all-reduce (MAX) per step: a signal
seen by any rank, or a timer due on any rank (so the slowest clock counts), makes every rank save the same step.

Signals. ``PreemptionWatcher`` turns the configured signal (``checkpoint.preemption_signal``, SIGTERM by default)
into a flag that the next step boundary reads. What a repeated signal does depends on who receives it:

* a process started by the launcher (a worker) ignores repeats: the launcher forwards the signal it receives,
  and schedulers such as Slurm also signal every process, so one preemption may arrive twice;
* a process running alone (``--nproc-per-node 1``) treats a second signal as "stop now": the default action.

The launcher side (forwarding the signal to the workers) is in ``automodel_ckpt.launch``.
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch


class PreemptionWatcher:
    """Records that the preemption signal arrived; ``requested`` is read at the next step boundary."""

    def __init__(self, signal_name: str | None, *, repeat_stops: bool) -> None:
        self.signal = signal.Signals[signal_name] if signal_name else None
        self.repeat_stops = repeat_stops
        self.received = 0
        self._previous = None
        self._installed = False

    @property
    def enabled(self) -> bool:
        return self.signal is not None

    @property
    def requested(self) -> bool:
        return self.received > 0

    @property
    def name(self) -> str:
        return self.signal.name if self.signal is not None else "signal"

    def install(self) -> None:
        """Catch the signal (main thread only; elsewhere Python cannot install handlers and nothing changes)."""
        if self.signal is None or self._installed or threading.current_thread() is not threading.main_thread():
            return
        self._previous = signal.signal(self.signal, self._handle)
        self._installed = True

    def uninstall(self) -> None:
        if self._installed and self.signal is not None:
            signal.signal(self.signal, self._previous if self._previous is not None else signal.SIG_DFL)
            self._installed = False

    def _handle(self, signum: int, frame: object) -> None:
        self.received += 1
        if self.received > 1 and self.repeat_stops:  # "stop now": the signal's default action
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)


class TimeTrigger:
    """Due when ``every_minutes`` have passed since the last save (or since training started)."""

    def __init__(self, every_minutes: float | None, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s = float(every_minutes) * 60.0 if every_minutes else None
        self.clock = clock
        self.last = clock()

    @property
    def enabled(self) -> bool:
        return self.every_s is not None

    def due(self) -> bool:
        return self.every_s is not None and self.clock() - self.last >= self.every_s

    def reset(self) -> None:
        """A checkpoint was just saved: the next one is due ``every_minutes`` from now."""
        self.last = self.clock()


@dataclass(frozen=True)
class Boundary:
    """What every rank agreed on at a step boundary."""

    preempt: bool = False
    time_due: bool = False


def _all_reduce_max(values: Sequence[int]) -> list[int]:
    import torch.distributed as dist

    t = torch.tensor(list(values), dtype=torch.int32)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [int(v) for v in t.tolist()]


class StepBoundary:
    """One agreement per step on "preempted?" and "a timed save is due?" (a single MAX all-reduce).

    Whether it runs at all depends only on the config, the same on every rank, so the collective stays matched.
    """

    def __init__(self, watcher: PreemptionWatcher, timer: TimeTrigger,
                 reduce_max: Callable[[Sequence[int]], list[int]] = _all_reduce_max) -> None:
        self.watcher = watcher
        self.timer = timer
        self.reduce_max = reduce_max

    @property
    def enabled(self) -> bool:
        return self.watcher.enabled or self.timer.enabled

    def check(self) -> Boundary:
        if not self.enabled:
            return Boundary()
        preempt, due = self.reduce_max([int(self.watcher.requested), int(self.timer.due())])
        return Boundary(preempt=bool(preempt), time_due=bool(due))

    def saved(self) -> None:
        self.timer.reset()
