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
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import torch

from automodel_ckpt.distributed.env import inside_launcher_worker
from automodel_ckpt.checkpoint.save_interval import mtbf_seconds, seconds
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


def _all_reduce_max(values: Sequence[float]) -> list[float]:
    """The elementwise maximum of ``values`` over every rank (flags as 0 or 1, seconds, hours)."""
    import torch.distributed as dist

    t = torch.tensor(list(values), dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


class StepBoundary:
    """One agreement per step on "preempted?" and "a timed save is due?" (a single MAX all-reduce).

    Whether it runs at all depends only on the config, the same on every rank, so the collective stays matched.
    """

    def __init__(self, watcher: PreemptionWatcher, timer: TimeTrigger,
                 reduce_max: Callable[[Sequence[float]], list[float]] = _all_reduce_max) -> None:
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


DEFAULT_MTBF_HOURS = 24.0  # with no checkpoint.mtbf_hours and no interruption in the run's cost log


class AutoInterval:
    """``step_scheduler.ckpt_every_steps: auto``: Young/Daly's interval from what the run's saves blocked the
    training thread, the step time and the MTBF, set on the run's ``SaveInterval`` (clamped there).

    ``interval_steps(cost_s, mtbf_s, step_s)``: the interval in steps (``tracking.advise``'s). After each durable
    save (``measured``, collective) one MAX all-reduce of (blocked seconds, seconds a step, MTBF) makes every rank
    hold the same sample, kept in the ``SaveInterval`` (its last 8). At each scheduled save, before the save's state
    is taken (``decide``), the interval is decided from the samples' medians: so the checkpoint holds the interval,
    the next due step and the samples the decision read, and a resume from it goes on where a straight run goes on.
    The save's own cost enters the next decision. Every rank measures its own save and steps (the median of the last
    steps' times). The MTBF is ``checkpoint.mtbf_hours``; else the interruptions in the run's cost log at the first
    save (rank 0 reads ``observed_mtbf_s``), else 24 h, decided once and kept in the ``SaveInterval``. Each change
    is one line (``say``, rank 0) and an ``interval`` record (``note``: events.jsonl and the trackers).

    ``checkpoint.local.every_steps: auto`` is the same rule for the node-local tier: ``schedule`` is its own
    ``SaveInterval`` (checkpointed with the step counters as ``local_interval``), the costs measured are a local
    step's, and its changes are ``Node-local interval`` lines and ``local_interval`` records.
    """

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
        """A step ended now: its time is from the end of the step before (or of the save after it); the step time
        is the median of the last 64, so that a step that validated does not count. At the first one after a
        resume whose checkpoint held a schedule out of range (``SaveInterval.restored_note``), rank 0 says what was
        dropped or clamped and which interval the run uses."""
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
        """A durable save after step ``steps.step`` blocked training ``blocked_s`` seconds (collective): one sample
        more, the same on every rank."""
        interval = self._interval(steps)
        if interval is None:
            return
        gaps = sorted(self._gaps)
        self._last = self.clock()  # the save's time is no step's
        step_s = gaps[len(gaps) // 2] if gaps else 0.0
        cost, step_s, mtbf = self.reduce_max([blocked_s, step_s, self._mtbf_local() if interval.mtbf is None
                                              else 0.0])
        if interval.mtbf is None:  # decided once a run, the same on every rank
            mtbf = mtbf_seconds(mtbf)
            source = "given" if self.mtbf_hours is not None and mtbf else "observed" if mtbf else "assumed"
            interval.mtbf = [mtbf or DEFAULT_MTBF_HOURS * 3600.0, source]
        if step_s > 0:
            interval.sample(cost, step_s)  # a number out of range is left out

    def decide(self, steps: Any) -> None:
        """A scheduled save at step ``steps.step`` is about to take the run's state: the interval from the samples
        so far (no collective: every rank holds the same samples). Every number is checked first (a restored
        schedule's were checked when loaded): the interval stays a whole number in ``[1, the run's last step]``."""
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
        """Collective (``StepBoundary.check``): what to save after the step just recorded."""
        agreed = self.boundary.check()
        scheduled = self.enabled and (self.steps.is_ckpt_step or agreed.time_due)
        durable = scheduled or (self.enabled and agreed.preempt)
        local = not durable and not self.steps.done and self.local_due(self.steps.step)
        return SaveDecision(durable=durable, local=local, preempt=agreed.preempt, scheduled=scheduled)

    def saved(self) -> None:
        """A durable checkpoint was just saved: the minutes count from now."""
        self.boundary.saved()
