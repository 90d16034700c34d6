"""Counts optimizer steps, epochs and samples, and decides when to validate, checkpoint and stop."""

from __future__ import annotations

from typing import Any

AUTO = "auto"


class SaveInterval:
    """``step_scheduler.ckpt_every_steps: auto``: the interval in steps, the next step that saves, and what the
    interval is decided from (the last saves' measured costs, the MTBF), all part of the run's state (checkpointed
    with the step counters), so that a resume goes on with the schedule a straight run has.

    The first save comes ``min_every_steps`` steps in (a save's cost is measured there); then the save cycle
    (``checkpoint.triggers.AutoInterval``) decides Young/Daly's interval at each scheduled save, before its state is
    taken, from the costs measured before it (``samples``), clamped to ``[min_every_steps, max_every_steps]``. The
    schedule counts from the last scheduled save: saves of the minutes, of a preemption or of the run's end do not
    move it.
    """

    SAMPLES = 8  # the last saves' costs a decision reads (their medians)

    def __init__(self, min_every: int = 1, max_every: int | None = None) -> None:
        self.min_every, self.max_every = max(1, int(min_every)), max_every
        self.every = self.clamp(self.min_every)
        self.next_step = self.every
        self.samples: list[list[float]] = []  # [blocked seconds, seconds a step] of the last saves, every rank's MAX
        self.mtbf: list[Any] | None = None  # [seconds, "given" | "observed" | "assumed"], decided once a run

    def clamp(self, every: int) -> int:
        every = max(self.min_every, int(every))
        return min(every, self.max_every) if self.max_every else every

    def due(self, step: int) -> bool:
        return step >= self.next_step

    def scheduled(self, step: int) -> None:
        """Step ``step`` saved: the next scheduled save is ``every`` steps on (when it was a scheduled one)."""
        if step >= self.next_step:
            self.next_step = step + self.every

    def change(self, every: int, step: int) -> bool:
        """Save every ``every`` steps (clamped) from the last scheduled save on, at a step after ``step``; whether
        the interval changed."""
        every = self.clamp(every)
        if every == self.every:
            return False
        self.next_step = max(step + 1, self.next_step - self.every + every)
        self.every = every
        return True

    def sample(self, blocked_s: float, step_s: float) -> None:
        """A save's measured cost and the step time then (the same numbers on every rank)."""
        self.samples = [*self.samples, [float(blocked_s), float(step_s)]][-self.SAMPLES:]

    def state_dict(self) -> dict[str, Any]:
        return {"every": self.every, "next_step": self.next_step, "samples": [list(s) for s in self.samples],
                "mtbf": list(self.mtbf) if self.mtbf else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.every, self.next_step = self.clamp(int(state["every"])), int(state["next_step"])
        self.samples = [[float(c), float(t)] for c, t in state.get("samples") or []][-self.SAMPLES:]
        mtbf = state.get("mtbf")
        self.mtbf = [float(mtbf[0]), str(mtbf[1])] if mtbf else None


class StepScheduler:
    """Training progress as three counters, plus the rules that read them.

    ``step`` is the number of optimizer steps completed (1-based in logs), ``epoch`` the epoch of the last
    step taken, ``consumed_samples`` the global number of training samples consumed so far.
    """

    def __init__(
        self,
        *,
        max_steps: int | None,
        num_epochs: int,
        steps_per_epoch: int,
        ckpt_every_steps: int | str | None = None,
        val_every_steps: int | None = None,
        min_every_steps: int = 1,
        max_every_steps: int | None = None,
    ) -> None:
        self.max_steps = max_steps
        self.num_epochs = num_epochs
        #: ``ckpt_every_steps: auto``: the interval that the save cycle sets (None: a fixed interval, or none)
        self.save_interval = SaveInterval(min_every_steps, max_every_steps) if ckpt_every_steps == AUTO else None
        self.ckpt_every_steps = None if ckpt_every_steps == AUTO else ckpt_every_steps
        #: ``checkpoint.local.every_steps: auto``: the node-local tier's interval (set by the recipe's checkpointer)
        self.local_interval: SaveInterval | None = None
        self.val_every_steps = val_every_steps
        self.steps_per_epoch = steps_per_epoch
        self.step = 0
        self.epoch = 0
        self.consumed_samples = 0

    @property
    def total_steps(self) -> int:
        by_epochs = self.steps_per_epoch * self.num_epochs
        return min(by_epochs, self.max_steps) if self.max_steps is not None else by_epochs

    def record_step(self, epoch: int, samples: int) -> None:
        self.step += 1
        self.epoch = epoch
        self.consumed_samples += samples

    @property
    def done(self) -> bool:
        return self.step >= self.total_steps

    @property
    def is_ckpt_step(self) -> bool:
        """Checkpoint every ``ckpt_every_steps`` (or where the ``auto`` interval is due) and after the last step."""
        if self.save_interval is not None:
            return self.done or self.save_interval.due(self.step)
        every = self.ckpt_every_steps
        return self.done or (every is not None and every > 0 and self.step % every == 0)

    @property
    def is_val_step(self) -> bool:
        every = self.val_every_steps
        return every is not None and every > 0 and self.step % every == 0

    def state_dict(self) -> dict[str, Any]:
        state = {"step": self.step, "epoch": self.epoch, "consumed_samples": self.consumed_samples}
        if self.save_interval is not None:
            state["save_interval"] = self.save_interval.state_dict()
        if self.local_interval is not None:
            state["local_interval"] = self.local_interval.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.epoch = int(state["epoch"])
        self.consumed_samples = int(state["consumed_samples"])
        if self.save_interval is not None and isinstance(state.get("save_interval"), dict):
            self.save_interval.load_state_dict(state["save_interval"])  # else (a fixed interval's): the first
        if self.local_interval is not None and isinstance(state.get("local_interval"), dict):
            self.local_interval.load_state_dict(state["local_interval"])
