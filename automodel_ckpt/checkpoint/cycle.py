"""The save cycle: at each step's end, what to save (steps, minutes, preemption, node-local tier).

``SaveCycle`` asks the ``SaveSchedule`` (one all-reduce at most); ``Checkpointer.step_end`` validates, saves and
times; the recipe learns from ``StepEnded`` what was saved and whether to stop.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

from automodel_ckpt.checkpoint.triggers import (AutoInterval, PreemptionWatcher, SaveDecision, SaveSchedule,
                                               StepBoundary, Steps, TimeTrigger)

States = Callable[[], dict[str, Any]]


class SaveObserver(Protocol):
    """What the run's observer (``tracking.RunObserver``) hears: each save and the final wait timed, side failures."""

    def save(self, save: Callable[[], Path | None], step: int, background: Callable[[], Any], *,
             preemption: bool = False) -> Path | None: ...

    def finalize(self, finalize: Callable[[], Any], step: int) -> Any: ...

    def side_failure(self, kind: str, text: str, step: int) -> None: ...


@dataclass(frozen=True)
class Restored:
    """What a restore loaded: the checkpoint (None: a fresh start), its states, its tier and how long it took."""

    path: Path | None
    states: tuple[str, ...] = ()
    tier: str | None = None
    seconds: float = 0.0


@dataclass(frozen=True)
class StepEnded:
    """What ``step_end`` did: the checkpoint it saved, the validation loss, and whether to stop (preempted)."""

    saved: Path | None = None
    val_loss: float | None = None
    preempted: bool = False
    stop: bool = False


class SaveCycle:
    """The step-end decision of one run (the minutes count from ``start``); the checkpointer acts on it."""

    def __init__(self, every_minutes: float | None, preemption: PreemptionWatcher | None, *, enabled: bool,
                 local_due: Callable[[int], bool], interval: AutoInterval | None = None) -> None:
        self.every_minutes = every_minutes if enabled else None
        self.interval = interval  # step_scheduler.ckpt_every_steps: auto (None: a fixed interval)
        self.blocked_s = 0.0  # what the last durable save blocked the training thread (the Checkpointer times it)
        self.preemption = preemption or PreemptionWatcher(None, repeat_stops=True)
        self.enabled, self.local_due = enabled, local_due
        self._boundary: StepBoundary | None = None
        self._schedule: SaveSchedule | None = None

    def start(self) -> None:
        """Training begins now: the minutes (``checkpoint.ckpt_every_minutes``) count from here."""
        self._boundary = StepBoundary(self.preemption, TimeTrigger(self.every_minutes))

    def decide(self, steps: Steps) -> SaveDecision:
        """What to save after optimizer step ``steps.step``, on every rank (one all-reduce at most)."""
        if self._boundary is None:
            self.start()
        if self._schedule is None:
            self._schedule = SaveSchedule(steps, self._boundary, enabled=self.enabled, local_due=self.local_due)
        if self.interval is not None:
            self.interval.tick(steps)  # a step ended: the interval's step time
        decision = self._schedule.decide()
        interval = getattr(steps, "save_interval", None)
        if decision.durable and interval is not None:  # before the save: the checkpoint holds the next save's step
            due = interval.due(steps.step)
            interval.scheduled(steps.step)
            if due and self.interval is not None:
                self.interval.decide(steps)  # and the interval decided from the costs measured before this save
        return decision

    def saved(self) -> None:
        """The durable checkpoint asked for is saved: the minutes restart; ``auto`` measures it (collective)."""
        self._schedule.saved()
        if self.interval is not None:
            self.interval.measured(self._schedule.steps, self.blocked_s)
