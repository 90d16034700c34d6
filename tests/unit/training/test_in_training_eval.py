"""The evaluation: section's checks, made when the run is set up (before any step), and the scores' names."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from automodel_ckpt.config.schema import EvaluationConfig
from automodel_ckpt.errors import ConfigError
from automodel_ckpt.evaluation.during_training import InTrainingEval, metric_name


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


def test_an_eval_score_has_its_own_best_pointer_that_restore_from_and_a_quarantine_follow(tmp_path):
    from automodel_ckpt.ondisk import catalog, layout
    from automodel_ckpt.ondisk.durable import read_pointer, set_pointer
    from automodel_ckpt.ondisk.metadata import write_metadata
    from automodel_ckpt.ondisk.quarantine import quarantine

    assert layout.best_pointer("val_loss") == layout.LOWEST_VAL
    assert layout.best_pointer(metric_name("addition", "exact_match")) == layout.BEST_EVAL
    assert layout.BEST_EVAL in layout.POINTERS and layout.BEST_EVAL in layout.RESERVED_NAMES
    for step, score in ((4, 0.5), (8, 0.25)):
        ckpt = tmp_path / f"epoch_0_step_{step}"
        ckpt.mkdir()
        write_metadata(ckpt, {"step": step, "epoch": 0, "val_metrics": {"eval/addition/exact_match": score}})
    set_pointer(tmp_path, layout.LATEST, "epoch_0_step_8")
    set_pointer(tmp_path, layout.BEST_EVAL, "epoch_0_step_4")
    assert catalog.resolve_restore_from(tmp_path, layout.BEST_EVAL) == tmp_path / "epoch_0_step_4"
    quarantine(tmp_path, "epoch_0_step_4", "damaged", monitor="eval/addition/exact_match", mode="max")
    assert read_pointer(tmp_path, layout.BEST_EVAL) == "epoch_0_step_8"  # the best one left
    assert read_pointer(tmp_path, layout.LOWEST_VAL) is None
