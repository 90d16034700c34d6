"""When a run saves: one ``SaveSchedule`` decision per step for every kind of save, and the preemption signal.

``SaveSchedule`` is asked once per step for a durable checkpoint (every ``step_scheduler.ckpt_every_steps`` and at
the end, every ``checkpoint.ckpt_every_minutes``, on a preemption signal) or a node-local step (every
``checkpoint.local.every_steps``) and answers with one ``SaveDecision``.

The minutes and the signal are decided at a step boundary by every rank together, with one small all-reduce (MAX) per step: a signal
seen by any rank, or a timer due on any rank (so the slowest clock counts), makes every rank save the same step.

Signals. ``PreemptionWatcher`` turns the configured signal (``checkpoint.preemption_signal``, SIGTERM by default)
into a flag that the next step boundary reads. What a repeated signal does depends on who receives it:

* a process started by the launcher (a worker) ignores repeats: the launcher forwards the signal it receives,
  and schedulers such as Slurm also signal every process, so one preemption may arrive twice;
* a process running alone (``--nproc-per-node 1``) treats a second signal as "stop now": the default action.

The launcher side (forwarding the signal to the workers) is in ``automodel_ckpt.launch``; the one step-end call
that asks the schedule and acts on its answer is ``cycle.SaveCycle`` (``Checkpointer.step_end``).
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import torch

from automodel_ckpt.distributed.env import inside_launcher_worker


class PreemptionWatcher:
    """Records that the preemption signal arrived; ``requested`` is read at the next step boundary."""

    def __init__(self, signal_name: str | None, *, repeat_stops: bool) -> None:
        self.signal = signal.Signals[signal_name] if signal_name else None
        self.repeat_stops = repeat_stops
        self.received = 0
        self._previous = None
        self._installed = False

    @classmethod
    def for_run(cls, cfg: Any) -> PreemptionWatcher:
        """The watcher of a run's ``checkpoint:`` section (``preemption_signal``, none when saving is off); a
        launcher's worker ignores repeats. Use it as ``with PreemptionWatcher.for_run(cfg) as preemption:`` around
        the whole run, setup included (a signal during setup is seen at the first step boundary)."""
        return cls(cfg.preemption_signal if cfg.enabled else None, repeat_stops=not inside_launcher_worker())

    def __enter__(self) -> PreemptionWatcher:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.repeat_stops:  # a worker keeps ignoring the signal while it exits: its exit code stays 0
            self.uninstall()

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


class Steps(Protocol):
    """The step counter a schedule reads (``training.step_scheduler.StepScheduler`` is one)."""

    step: int

    @property
    def done(self) -> bool: ...

    @property
    def is_ckpt_step(self) -> bool: ...


@dataclass(frozen=True)
class SaveDecision:
    """What the step just taken saves, the same on every rank."""

    durable: bool = False  # a durable checkpoint now (the step schedule, the minutes or a preemption)
    local: bool = False  # a node-local step now (never beside a durable checkpoint, never after the last step)
    preempt: bool = False  # preempted: save, then stop
    scheduled: bool = False  # the durable save is one of the schedule's (not only the preemption's): validated first


class SaveSchedule:
    """The one place the recipe asks "save now?" after each optimizer step; one collective at most per step."""

    def __init__(self, steps: Steps, boundary: StepBoundary, *, enabled: bool,
                 local_due: Callable[[int], bool]) -> None:
        self.steps, self.boundary, self.enabled, self.local_due = steps, boundary, enabled, local_due

    def decide(self) -> SaveDecision:
        """Collective (``StepBoundary.check``): what to save after the step just recorded."""
        agreed = self.boundary.check()
        scheduled = self.enabled and (self.steps.is_ckpt_step or agreed.time_due)
        durable = scheduled or (self.enabled and agreed.preempt)
        local = not durable and not self.steps.done and self.local_due(self.steps.step)
        return SaveDecision(durable=durable, local=local, preempt=agreed.preempt, scheduled=scheduled)

    def saved(self) -> None:
        """A durable checkpoint was just saved: the minutes count from now."""
        self.boundary.saved()
