"""torchtitan's schedules as ours step by step (against its own ``LRSchedulersContainer``), and the recipe's model
handed to a source that needs it (``ForeignRun.fit``) before ``apply`` matches anything."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from automodel_ckpt.interop import schedules, torchtitan
from automodel_ckpt.interop.apply import apply
from automodel_ckpt.interop.source import ForeignRun, Schedule

SECTIONS = [{"warmup_steps": 2, "decay_type": "cosine", "min_lr_factor": 0.1},
            {"warmup_steps": 3, "decay_type": "linear", "decay_ratio": 0.4},
            {"warmup_steps": 0, "decay_type": "sqrt", "min_lr_factor": 0.2, "decay_ratio": 0.5},
            {"warmup_steps": 5, "decay_type": "linear", "decay_ratio": 0.0},
            {"warmup_steps": 40, "decay_type": "cosine"},  # a warmup past the end: torchtitan cuts it there
            {"warmup_steps": 4, "decay_type": "cosine", "decay_ratio": 0.9}]  # a decay into the warmup: cut too


@pytest.mark.parametrize("section", SECTIONS)
def test_torchtitan_s_schedules_are_ours_at_every_step(section):
    pytest.importorskip("torchtitan")
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    steps = 20
    groups = [ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3})]
    optimizers = OptimizersContainer(OptimizersContainer.Config(param_groups=groups, implementation="for-loop"),
                                     model_parts=[torch.nn.Linear(2, 2)])
    theirs = LRSchedulersContainer.Config(**section).build(optimizers=optimizers, training_steps=steps)
    ours = torchtitan._schedule({"lr_scheduler": section, "training": {"steps": steps}}, "job_config.json", 0)
    factor = schedules.factor_function(ours)
    for step in range(steps + 1):
        assert math.isclose(factor(step), theirs.schedulers[0].lr_lambdas[0](step), rel_tol=1e-9, abs_tol=1e-12), step


class Fitted(Exception):
    pass


def test_apply_hands_the_recipe_s_model_to_the_source_first():
    model = torch.nn.Linear(2, 2)

    def fit(given):
        assert given is model
        raise Fitted

    run = ForeignRun(kind="a source", weights={}, adapter=False, moments=[], groups=[], order=lambda m: [],
                     schedule=Schedule("none", None), step=1, position=lambda rows, batch: (0, 1, 1),
                     global_batch=None, world_size=1, rng=None, fit=fit)
    recipe = SimpleNamespace(model=model, optimizer=torch.optim.AdamW(model.parameters()))
    with pytest.raises(Fitted):
        apply(run, recipe, "src", print)
