"""A step whose loss or gradient norm is not finite stops the run before it saves (``refuse_non_finite``, called by
``FinetuneRecipe.train`` for every algorithm between the step and the checkpointer); a finite one goes on. A real run
that reaches one: ``tests/integration/test_train.py``."""

from __future__ import annotations

import math

import pytest

from automodel_ckpt.errors import TrainingError, UserError
from automodel_ckpt.recipes.llm_finetune import refuse_non_finite


@pytest.mark.parametrize("loss, grad_norm, name", [
    (math.nan, 1.0, "loss"), (math.inf, 1.0, "loss"), (-math.inf, 1.0, "loss"),
    (2.5, math.nan, "gradient norm"), (2.5, math.inf, "gradient norm"), (math.nan, math.nan, "loss"),
])
def test_a_step_not_finite_stops_the_run_in_one_line(loss, grad_norm, name):
    with pytest.raises(TrainingError) as caught:
        refuse_non_finite(7, loss, grad_norm)
    line = str(caught.value)
    assert isinstance(caught.value, UserError) and "\n" not in line  # the CLI's one ``error:`` line, exit non-zero
    assert line.startswith(f"step 7: the {name} is ") and "not a finite number" in line


@pytest.mark.parametrize("loss, grad_norm", [(0.0, 0.0), (-1.7e-17, 5.4), (1e300, 1e30), (-3.0, 0.0)])
def test_a_finite_step_goes_on(loss, grad_norm):
    refuse_non_finite(1, loss, grad_norm)
