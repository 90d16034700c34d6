"""Counts optimizer steps, epochs and samples, and decides when to validate, checkpoint and stop."""

from __future__ import annotations

from typing import Any


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
        ckpt_every_steps: int | None = None,
        val_every_steps: int | None = None,
    ) -> None:
        self.max_steps = max_steps
        self.num_epochs = num_epochs
        self.ckpt_every_steps = ckpt_every_steps
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
        """Checkpoint every ``ckpt_every_steps`` and always after the last step."""
        every = self.ckpt_every_steps
        return self.done or (every is not None and every > 0 and self.step % every == 0)

    @property
    def is_val_step(self) -> bool:
        every = self.val_every_steps
        return every is not None and every > 0 and self.step % every == 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "epoch": self.epoch, "consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.epoch = int(state["epoch"])
        self.consumed_samples = int(state["consumed_samples"])
