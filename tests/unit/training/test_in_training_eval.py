"""The evaluation: section's checks, made when the run is set up (before any step), and the scores' names."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from automodel_ckpt.config.schema import EvaluationConfig
from automodel_ckpt.errors import ConfigError
from automodel_ckpt.training.evaluation import InTrainingEval, metric_name


def _section(**keys):
    return OmegaConf.merge(OmegaConf.structured(EvaluationConfig), keys)


def test_off_by_default_and_never_due():
    ev = InTrainingEval(_section(), is_main=False, pp_size=1, peft=False)
    assert not any(ev.due(step) for step in range(1, 10))


def test_due_every_n_steps():
    ev = InTrainingEval(_section(every_steps=4, tasks=["addition"]), is_main=False, pp_size=1, peft=False)
    assert [s for s in range(1, 13) if ev.due(s)] == [4, 8, 12]
    assert metric_name("addition", "exact_match") == "eval/addition/exact_match"


@pytest.mark.parametrize("keys,pp,peft,match", [
    ({"every_steps": 0, "tasks": ["addition"]}, 1, False, "every_steps: expected a positive integer"),
    ({"every_steps": 4}, 1, False, "evaluation.tasks"),
    ({"every_steps": 4, "tasks": ["addition"]}, 2, False, "pp_size 1"),
    ({"every_steps": 4, "tasks": ["addition"]}, 1, True, "without LoRA"),
])
def test_refusals_in_one_line(keys, pp, peft, match):
    with pytest.raises(ConfigError, match=match):
        InTrainingEval(_section(**keys), is_main=False, pp_size=pp, peft=peft)
