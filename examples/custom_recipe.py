"""A recipe from ``BaseRecipe``: its own model, data and state; ``ckpt-train examples/custom_recipe.yaml``."""
import torch

from automodel_ckpt.checkpoint import Checkpointer, PreemptionWatcher, run_folder
from automodel_ckpt.config.loader import to_yaml
from automodel_ckpt.distributed.env import init_distributed
from automodel_ckpt.recipes import BaseRecipe
from automodel_ckpt.tracking import RunObserver
from automodel_ckpt.training.rng import RNGState, seed_everything
from automodel_ckpt.training.step_scheduler import StepScheduler


class Seen:
    samples = 0  # the recipe's own state, in every checkpoint: samples trained on so far

    def state_dict(self) -> dict:
        return {"samples": self.samples}

    def load_state_dict(self, state: dict) -> None:
        self.samples = state["samples"]


class LineFitRecipe(BaseRecipe):
    """Fits y = 3x - 1; exact resume, preemption, node-local tier, trackers, retention: the Checkpointer's calls."""

    def run(self) -> None:
        cfg, steps, ckpt = self.cfg, self.cfg.step_scheduler, self.checkpoint_config
        with PreemptionWatcher.for_run(ckpt) as preemption:  # first: a signal during setup is not lost
            env = init_distributed(cfg.distributed.backend, cfg.distributed.timeout_minutes)
            seed_everything(cfg.seed)
            self.model, self.rng, self.seen = torch.nn.Linear(1, 1), RNGState(), Seen()  # state: each public
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05)  # attribute with a state_dict
            self.step_scheduler = sched = StepScheduler(max_steps=steps.max_steps, steps_per_epoch=steps.max_steps,
                                                        num_epochs=1, ckpt_every_steps=steps.ckpt_every_steps)
            observer = RunObserver(cfg.logging, run_folder(ckpt), is_main=env.is_main, config_yaml=to_yaml(cfg))
            self.tracking = observer.tracker if observer.tracker.requested else None  # a resume reopens its runs
            self.checkpointer = Checkpointer(ckpt, env, resolved_config_yaml=to_yaml(cfg), preemption=preemption,
                                             observer=observer)
            try:
                restored = self.restore_checkpoint()  # the newest checkpoint that loads, if any
                observer.start(sched.step, restored)
                while not sched.done:
                    x = torch.randn(steps.global_batch_size, 1)
                    loss = torch.nn.functional.mse_loss(self.model(x), 3 * x - 1)
                    loss.backward()
                    self.optimizer.step()
                    self.optimizer.zero_grad()
                    self.seen.samples += len(x)
                    sched.record_step(0, len(x))
                    observer.log_train(record := {"step": sched.step, "loss": loss.item(), "seen": self.seen.samples})
                    if env.is_main:
                        print(record, flush=True)
                    if self.checkpointer.step_end(self.checkpointed_state, sched, epoch=0, loss=loss.item()).stop:
                        break  # preempted: saved, and the run stops
                self.checkpointer.finalize()
                observer.end(sched.step, "complete" if sched.done else "preempted")
            except BaseException:
                observer.fail()
                self.checkpointer.finalize(failed=True)  # background writes end, nothing half-written is published
                raise
