"""Counts optimizer steps, epochs and samples, and decides when to validate, checkpoint and stop."""

from __future__ import annotations

from typing import Any

from automodel_ckpt.errors import CheckpointError
from automodel_ckpt.shown import shown_value
from automodel_ckpt.checkpoint import SaveInterval
from automodel_ckpt.ondisk import is_count

AUTO = "auto"
COUNTERS = ("step", "epoch", "consumed_samples")


class StepScheduler:
    """Training progress (steps done, the last step's epoch, samples consumed) and the rules that read it."""

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
        self.max_steps, self.num_epochs, self.steps_per_epoch = max_steps, num_epochs, steps_per_epoch
        #: ``ckpt_every_steps: auto``: the interval that the save cycle sets (None: a fixed interval, or none)
        self.save_interval = SaveInterval(min_every_steps, max_every_steps, lambda: self.total_steps) \
            if ckpt_every_steps == AUTO else None
        self.ckpt_every_steps = None if ckpt_every_steps == AUTO else ckpt_every_steps
        #: ``checkpoint.local.every_steps: auto``: the node-local tier's interval (set by the recipe's checkpointer)
        self.local_interval: SaveInterval | None = None
        self.val_every_steps = val_every_steps
        #: a run in stages: this stage ends after this step (saved there; the run goes on in the next stage)
        self.stop_at: int | None = None
        #: a run in stages: its last step by the epochs of the data left (set at the restore; None: the formula)
        self.epochs_end: int | None = None
        self.step = 0
        self.epoch = 0
        self.consumed_samples = 0

    @property
    def total_steps(self) -> int:
        by_epochs = self.steps_per_epoch * self.num_epochs if self.epochs_end is None else self.epochs_end
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
        """Every ``ckpt_every_steps`` (or where ``auto`` is due), after the last step and where a stage ends."""
        if self.stage_ends:
            return True
        if self.save_interval is not None:
            return self.done or self.save_interval.due(self.step)
        every = self.ckpt_every_steps
        return self.done or (every is not None and every > 0 and self.step % every == 0)

    @property
    def stage_ends(self) -> bool:
        """The step just taken ends this launch's stage (``stop_at``), before the run's end."""
        return self.stop_at is not None and self.step == self.stop_at and not self.done

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

    def load_state_dict(self, state: Any) -> None:
        """A checkpoint's counters (untrusted), each a count; an ``auto`` schedule checked by ``SaveInterval``."""
        if not isinstance(state, dict):
            raise CheckpointError(f"the step counters are a {type(state).__name__}, not a mapping")
        for key in COUNTERS:
            value = state.get(key)
            if not is_count(value):
                raise CheckpointError(f"the step counters: '{key}' is {shown_value(value)}, not a count")
        self.step, self.epoch, self.consumed_samples = (state[key] for key in COUNTERS)
        for interval, key in ((self.save_interval, "save_interval"), (self.local_interval, "local_interval")):
            if interval is not None and key in state:  # absent (a fixed interval's): the schedule starts afresh
                interval.load_state_dict(state[key], self.step)
