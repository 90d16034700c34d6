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
    ({"every_steps": 4, "tasks": ["addition"]}, 2, False, "each pipeline stage holds only its layers"),
    ({"every_steps": 4, "tasks": ["addition"]}, 2, True, "each pipeline stage holds only its layers"),
])
def test_refusals_in_one_line(keys, pp, peft, match):
    with pytest.raises(ConfigError, match=match):
        InTrainingEval(_section(**keys), is_main=False, pp_size=pp, peft=peft)


def test_a_lora_model_is_scored_with_its_adapter_merged_into_a_fresh_copy():
    import copy

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from automodel_ckpt.evaluation.during_training import scoring_copy

    InTrainingEval(_section(every_steps=4, tasks=["addition"]), is_main=False, pp_size=1, peft=True)  # accepted
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # a trained adapter: B is no longer zero
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    scored = scoring_copy(model, model.state_dict())
    want = copy.deepcopy(model).merge_and_unload().state_dict()
    got = scored.state_dict()
    assert type(scored) is LlamaForCausalLM and set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(got[name], before[f"base_model.model.{name.replace('.weight', '.base_layer.weight')}"])
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the training model untouched


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
