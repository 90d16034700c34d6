"""The save cycle: at each step's end, what to save (steps, minutes, preemption, node-local tier), and saving it.

``Checkpointer.step_end`` is the one call a recipe makes after each optimizer step. It asks the ``SaveSchedule``
(``triggers``: one all-reduce at most), validates first when a scheduled save records a validation loss, saves a
durable checkpoint or takes a node-local step, times the save for the cost report (the run's ``SaveObserver``), and
reports the node-local steps abandoned since the last call. The recipe learns what happened from ``StepEnded``:
what was saved, and whether to stop (preempted).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

from automodel_ckpt.checkpoint.triggers import PreemptionWatcher, SaveSchedule, StepBoundary, Steps, TimeTrigger
from automodel_ckpt.ondisk.info import SaveInfo

States = Callable[[], dict[str, Any]]


class SaveObserver(Protocol):
    """What the run's observer hears of saves (``tracking.RunObserver`` is one): each save timed, the final wait
    timed, side work that failed (``kind``: ``local_step``, ...)."""

    def save(self, save: Callable[[], Path | None], step: int, background: Callable[[], Any], *,
             preemption: bool = False) -> Path | None: ...

    def finalize(self, finalize: Callable[[], Any], step: int) -> Any: ...

    def side_failure(self, kind: str, text: str, step: int) -> None: ...


class _Saves(Protocol):
    """The checkpointer's saves, as the cycle uses them (looked up at each call: a wrapped ``save`` is seen)."""

    enabled: bool
    background: Any

    def save(self, states: dict[str, Any], info: SaveInfo) -> Path | None: ...

    def save_local(self, states: dict[str, Any], info: SaveInfo) -> Path | None: ...

    def local_due(self, step: int) -> bool: ...

    def local_faults(self) -> list[str]: ...


@dataclass(frozen=True)
class Restored:
    """What a restore loaded: the checkpoint (None: a fresh start), its states, its tier and how long it took."""

    path: Path | None
    states: tuple[str, ...] = ()
    tier: str | None = None
    seconds: float = 0.0


@dataclass(frozen=True)
class StepEnded:
    """What ``step_end`` did: the durable checkpoint it saved (if any), the validation loss (if it validated), and
    whether the run stops now (preempted before its last step: ``finalize`` and return)."""

    saved: Path | None = None
    val_loss: float | None = None
    preempted: bool = False
    stop: bool = False


class SaveCycle:
    """The step-end decision and its act, for one run; the minutes count from ``start`` (training begins)."""

    def __init__(self, saves: _Saves, every_minutes: float | None, preemption: PreemptionWatcher | None,
                 observer: SaveObserver | None) -> None:
        self.saves = saves
        self.every_minutes = every_minutes
        self.preemption = preemption or PreemptionWatcher(None, repeat_stops=True)
        self.observer = observer
        self.step = 0  # the last step ended (the final wait's cost is recorded at it)
        self._boundary: StepBoundary | None = None
        self._schedule: SaveSchedule | None = None

    def start(self) -> None:
        """Training begins now: the minutes (``checkpoint.ckpt_every_minutes``) count from here."""
        minutes = self.every_minutes if self.saves.enabled else None
        self._boundary = StepBoundary(self.preemption, TimeTrigger(minutes))

    def step_end(self, states: States, steps: Steps, *, epoch: int, loss: float,
                 extra: Callable[[], dict[str, Any]] | None = None, validate: Callable[[], float] | None = None,
                 validate_now: bool = False) -> StepEnded:
        if self._boundary is None:
            self.start()
        if self._schedule is None:
            self._schedule = SaveSchedule(steps, self._boundary, enabled=self.saves.enabled,
                                          local_due=self.saves.local_due)
        self.step = step = steps.step
        due = self._schedule.decide()  # every rank: what to save now (one all-reduce, if minutes or a signal apply)
        val_loss = validate() if validate is not None and (validate_now or due.scheduled) else None
        saved = None
        if due.durable:
            info = SaveInfo(epoch, step, loss, val_loss, is_final=steps.done, extra=extra() if extra else {})
            saved = self._timed(lambda: self.saves.save(states(), info), step, due.preempt)
            self._schedule.saved()
        elif due.local:  # node-local: the snapshot only
            self.saves.save_local(states(), SaveInfo(epoch, step, loss, val_loss, is_final=False,
                                                     extra=extra() if extra else {}))
        self.report_faults()
        return StepEnded(saved=saved, val_loss=val_loss, preempted=due.preempt, stop=due.preempt and not steps.done)

    def finalize(self, finalize: Callable[[], Path | None]) -> Path | None:
        """The run's last wait (``Checkpointer.finalize``), timed for the cost report; then the faults it left."""
        if self.observer is None:
            return finalize()
        path = self.observer.finalize(finalize, self.step)
        self.report_faults()
        return path

    def report_faults(self) -> None:
        """Node-local steps abandoned (or written again) since the last call, to the observer (events.jsonl and the
        trackers); without an observer they wait for ``Checkpointer.local_faults``."""
        if self.observer is None:
            return
        for line in self.saves.local_faults():
            self.observer.side_failure("local_step", line, self.step)

    def _timed(self, save: Callable[[], Path | None], step: int, preemption: bool) -> Path | None:
        if self.observer is None:
            return save()
        return self.observer.save(save, step, self._background, preemption=preemption)

    def _background(self) -> Any:
        """The async save just started, if any (its fence wait and background time are part of its cost)."""
        return self.saves.background
