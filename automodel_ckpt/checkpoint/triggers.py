"""When a run saves: one ``SaveSchedule`` decision per step for every kind of save, and the preemption signal.

The minutes and the signal are agreed at each step boundary with one MAX all-reduce: a signal seen by any rank, or a
timer due on any rank (the slowest clock counts), makes every rank save the same step. A launcher's worker ignores
a repeated signal (one preemption may reach it twice, directly and forwarded); a process alone stops at the second
(docs/async.md). ``cycle.SaveCycle`` acts on the decision.
"""

from __future__ import annotations

import signal
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import torch

from automodel_ckpt.distributed.env import inside_launcher_worker
from automodel_ckpt.checkpoint.save_interval import DEFAULT_MTBF_HOURS, mtbf_seconds, seconds
from automodel_ckpt.ondisk.bounded import COUNT_LIMIT


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
        """The watcher of a run's ``checkpoint:``; a ``with`` around the whole run, setup included."""
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
        self.last = self.clock()


@dataclass(frozen=True)
class Boundary:
    preempt: bool = False
    time_due: bool = False


def _all_reduce_max(values: Sequence[float]) -> list[float]:
    import torch.distributed as dist

    t = torch.tensor(list(values), dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


class StepBoundary:
    """One MAX all-reduce a step ("preempted?", "timed save due?"), run or not by the config alone (matched)."""

    def __init__(self, watcher: PreemptionWatcher, timer: TimeTrigger,
                 reduce_max: Callable[[Sequence[float]], list[float]] = _all_reduce_max) -> None:
        self.watcher, self.timer, self.reduce_max = watcher, timer, reduce_max

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
    """The step counter a schedule reads (``StepScheduler``)."""

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


class AutoInterval:
    """``ckpt_every_steps: auto``: Young/Daly's interval (``interval_steps(cost_s, mtbf_s, step_s)``) from what the
    saves blocked, the step time and the MTBF, set on the run's ``SaveInterval`` (docs/tracking.md). It is decided
    before a save takes its state, from samples in that state, so a resume goes on as a straight run does.
    ``schedule``: the node-local tier's own ``SaveInterval`` (``local.every_steps: auto``, docs/fast-recovery.md)."""

    def __init__(self, interval_steps: Callable[[float, float, float], int], *, mtbf_hours: float | None,
                 observed_mtbf_s: Callable[[], float | None], is_main: bool, say: Callable[[str], None],
                 note: Callable[[dict[str, Any]], None],
                 reduce_max: Callable[[Sequence[float]], list[float]] = _all_reduce_max,
                 clock: Callable[[], float] = time.monotonic, schedule: Any = None) -> None:
        self.interval_steps, self.mtbf_hours, self.observed_mtbf_s = interval_steps, mtbf_hours, observed_mtbf_s
        self.is_main, self.say, self.note, self.reduce_max, self.clock = is_main, say, note, reduce_max, clock
        self.schedule = schedule  # the node-local tier's SaveInterval (None: the durable one, ``steps.save_interval``)
        self.label, self.event, self.noun = ("Checkpoint interval", "interval", "save") if schedule is None else \
            ("Node-local interval", "local_interval", "local step")
        self._gaps: deque[float] = deque(maxlen=64)  # the last steps' times
        self._last: float | None = None  # when the last step ended (or the last save, which is no step's time)

    def _interval(self, steps: Any) -> Any:
        return self.schedule if self.schedule is not None else getattr(steps, "save_interval", None)

    def tick(self, steps: Any = None) -> None:
        """A step ended now (the step time is the median of the last 64: a step that validated does not count); after
        a resume whose schedule was out of range, rank 0 says what was dropped."""
        now = self.clock()
        if self._last is not None:
            self._gaps.append(now - self._last)
        self._last = now
        interval = self._interval(steps) if steps is not None else None
        if interval is not None and interval.restored_note:
            note, interval.restored_note = interval.restored_note, None
            if self.is_main:
                self.say(f"warning: {self.label}: the checkpoint's schedule was out of range: {note}")

    def _mtbf_local(self) -> float:
        """This rank's MTBF in seconds (0: none): the config's, else (rank 0) the run's cost log's when in range."""
        if self.mtbf_hours is not None:
            return mtbf_seconds(float(self.mtbf_hours) * 3600.0) or 0.0
        return (mtbf_seconds(self.observed_mtbf_s()) or 0.0) if self.is_main else 0.0

    def measured(self, steps: Any, blocked_s: float) -> None:
        """Collective: a durable save blocked training ``blocked_s``: one sample more, the same on every rank."""
        interval = self._interval(steps)
        if interval is None:
            return
        gaps = sorted(self._gaps)
        self._last = self.clock()  # the save's time is no step's
        step_s = gaps[len(gaps) // 2] if gaps else 0.0
        cost, step_s, mtbf = self.reduce_max([blocked_s, step_s, self._mtbf_local() if interval.mtbf is None else 0.0])
        if interval.mtbf is None:  # decided once a run, the same on every rank
            mtbf = mtbf_seconds(mtbf)
            source = "given" if self.mtbf_hours is not None and mtbf else "observed" if mtbf else "assumed"
            interval.mtbf = [mtbf or DEFAULT_MTBF_HOURS * 3600.0, source]
        if step_s > 0:
            interval.sample(cost, step_s)  # a number out of range is left out

    def decide(self, steps: Any) -> None:
        """Before a scheduled save takes the state: the interval from the samples (the same on every rank, no
        collective), each number checked first so that it stays a whole number in ``[1, the run's last step]``."""
        interval = self._interval(steps)
        if interval is None or not interval.samples or interval.mtbf is None:
            return
        step = steps.step
        cost, step_s = (sorted(s[k] for s in interval.samples)[len(interval.samples) // 2] for k in (0, 1))
        mtbf, source = interval.mtbf
        if self.mtbf_hours is not None and mtbf_seconds(float(self.mtbf_hours) * 3600.0):  # the config's, even
            mtbf, source = float(self.mtbf_hours) * 3600.0, "given"  # where a resume's checkpoint holds another
        if seconds(cost) is None or seconds(step_s, positive=True) is None or mtbf_seconds(mtbf) is None:
            return
        wanted = self.interval_steps(cost, mtbf, step_s)
        if not isinstance(wanted, (int, float)) or isinstance(wanted, bool) or wanted != wanted:
            return
        before = interval.every
        if not interval.change(wanted, step):
            return
        shown = wanted if isinstance(wanted, int) else f"{wanted:.4g}"
        top = interval.longest
        clamped = "" if interval.every == wanted else \
            f", clamped to [{interval.min_every}, {top if top < COUNT_LIMIT else 'no limit'}]"
        line = (f"{self.label}: every {interval.every} steps (was {before}): Young/Daly's interval for "
                f"{cost:.3f} s blocked a {self.noun}, {step_s:.4f} s a step and an MTBF of {mtbf / 3600:.4g} h ({source}) "
                f"is {shown} steps{clamped}; next {self.noun} at step {interval.next_step}")
        if self.is_main:
            self.say(line)
        self.note({"event": self.event, "time": time.time(), "step": step, "every_steps": interval.every,
                   "was_every_steps": before, "next_step": interval.next_step, "blocked_s": round(cost, 4),
                   "step_s": round(step_s, 6), "mtbf_s": mtbf, "mtbf_source": source,
                   "young_daly_steps": wanted if isinstance(wanted, int) else None,
                   "samples": len(interval.samples), "text": line})


class SaveSchedule:
    """The one place the recipe asks "save now?" after each optimizer step; one collective at most per step."""

    def __init__(self, steps: Steps, boundary: StepBoundary, *, enabled: bool,
                 local_due: Callable[[int], bool]) -> None:
        self.steps, self.boundary, self.enabled, self.local_due = steps, boundary, enabled, local_due

    def decide(self) -> SaveDecision:
        agreed = self.boundary.check()
        scheduled = self.enabled and (self.steps.is_ckpt_step or agreed.time_due)
        durable = scheduled or (self.enabled and agreed.preempt)
        local = not durable and not self.steps.done and self.local_due(self.steps.step)
        return SaveDecision(durable=durable, local=local, preempt=agreed.preempt, scheduled=scheduled)

    def saved(self) -> None:
        self.boundary.saved()
