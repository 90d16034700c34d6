"""A recipe from ``BaseRecipe``: its own model, data, state and step; ``ckpt-train examples/custom_recipe.yaml``."""
import torch

from automodel_ckpt.recipes import BaseRecipe
from automodel_ckpt.training.rng import RNGState
from automodel_ckpt.training.step_scheduler import StepScheduler


class Seen:
    samples = 0  # the recipe's own state, in every checkpoint: samples trained on so far

    def state_dict(self) -> dict:
        return {"samples": self.samples}

    def load_state_dict(self, state: dict) -> None:
        self.samples = state["samples"]


class LineFitRecipe(BaseRecipe):
    """Fits y = 3x - 1; exact resume, preemption, node-local tier, trackers, retention: BaseRecipe's wiring."""

    def setup(self) -> None:
        steps = self.cfg.step_scheduler
        self.setup_distributed()  # the process group, then the seed
        self.model, self.rng, self.seen = torch.nn.Linear(1, 1), RNGState(), Seen()  # state: each public
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05)  # attribute with a state_dict
        self.step_scheduler = StepScheduler(max_steps=steps.max_steps, steps_per_epoch=steps.max_steps, num_epochs=1,
                                            ckpt_every_steps=steps.ckpt_every_steps)
        self.build_checkpointer()  # last: the trackers and the checkpointer, given the preemption watcher

    def step(self) -> dict:  # one optimizer step; BaseRecipe logs its record and calls the checkpointer
        x = torch.randn(self.cfg.step_scheduler.global_batch_size, 1)
        loss = torch.nn.functional.mse_loss(self.model(x), 3 * x - 1)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.seen.samples += len(x)
        self.step_scheduler.record_step(0, len(x))
        return {"step": self.step_scheduler.step, "loss": loss.item(), "seen": self.seen.samples}
