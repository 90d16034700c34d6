"""A GRPO recipe whose rank 0 stops itself (SIGSTOP) once a given step is logged (``step_faults``' hook)."""

from __future__ import annotations

from automodel_ckpt.recipes.grpo import GRPO
from tests.integration.step_faults import StopAfterStepRecipe

RECIPE = "tests.integration.grpo_faults.StopAfterStepGRPORecipe"


class StopAfterStepGRPORecipe(StopAfterStepRecipe):
    """``GRPORecipe`` whose rank 0 stops after step ``STOP_AFTER_STEP`` (``tests/integration/step_faults.py``)."""

    algorithm_class = GRPO
