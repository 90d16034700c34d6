"""The run fingerprint: what changes a checkpoint's meaning is named, what may change between runs is not."""

from __future__ import annotations

import json

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from automodel_ckpt.checkpoint.restore.probe import check_same_run
from automodel_ckpt.errors import CheckpointError
from automodel_ckpt.ondisk.fingerprint import STAGE_KEYS, first_difference, run_fingerprint
from automodel_ckpt.models.tiny import build_tokenizer


def _model(**overrides):
    cfg = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
               num_key_value_heads=2)
    cfg.update(overrides)
    return LlamaForCausalLM(LlamaConfig(**cfg))


RECIPE = {"dataset": {"_target_": "automodel_ckpt.data.builtin.builtin_task_dataset", "seed": 1234},
          "seq_length": 16, "global_batch_size": 64}


def _roundtrip(fp):
    return json.loads(json.dumps(fp))  # as read back from metadata.json


def test_same_run_matches_after_a_json_roundtrip() -> None:
    tok = build_tokenizer()
    saved = _roundtrip(run_fingerprint(_model(), tok, None, RECIPE))
    assert first_difference(saved, run_fingerprint(_model(), tok, None, RECIPE)) is None


def test_runtime_only_config_keys_do_not_block() -> None:
    saved = _roundtrip(run_fingerprint(_model(), None, None, RECIPE))
    model = _model(use_cache=False)
    model.config._attn_implementation = "eager"
    assert first_difference(saved, run_fingerprint(model, None, None, RECIPE)) is None


@pytest.mark.parametrize("change, words", [
    ({"vocab_size": 96}, "model config key 'vocab_size' is 64 there, 96 here"),
    ({"num_hidden_layers": 2}, "model config key 'num_hidden_layers' is 1 there, 2 here"),
    ({"vocab_size": 96, "num_hidden_layers": 2}, "model config keys differ: 'num_hidden_layers' is 1 there, 2 here; "
                                                 "'vocab_size' is 64 there, 96 here"),
])
def test_architecture_change_is_named(change, words) -> None:
    saved = _roundtrip(run_fingerprint(_model(), None, None, RECIPE))
    assert first_difference(saved, run_fingerprint(_model(**change), None, None, RECIPE)) == words


def test_tokenizer_peft_and_recipe_changes_are_named() -> None:
    tok = build_tokenizer()
    saved = _roundtrip(run_fingerprint(_model(), tok, None, RECIPE))

    class Other:
        def get_vocab(self):
            return {"a": 0, "b": 1}

    assert first_difference(saved, run_fingerprint(_model(), Other(), None, RECIPE)).startswith(
        "the tokenizer's vocabulary differs")
    assert first_difference(saved, run_fingerprint(_model(), tok, {"rank": 8}, RECIPE)) == \
        "LoRA (peft:) is off there, on here"
    other = dict(RECIPE, seq_length=32)
    assert first_difference(saved, run_fingerprint(_model(), tok, None, other)) == \
        "recipe key 'seq_length' is 16 there, 32 here"
    many = dict(RECIPE, a=1, b=2, c=3, seq_length=32)
    assert first_difference(saved, run_fingerprint(_model(), tok, None, many)) == \
        "recipe keys differ: 'a' is unset there and 1 here; 'b' is unset there and 2 here; 'c' is unset there and 3 " \
        "here and 1 more"


def test_checkpoints_without_a_fingerprint_never_block() -> None:
    assert first_difference(None, run_fingerprint(_model(), None, None, RECIPE)) is None


def test_derived_keys_still_name_a_difference() -> None:
    """A changed key that another derives from: both are named, so the key the user changed is among them."""
    saved = _roundtrip(run_fingerprint(_model(), None, None, RECIPE))
    words = first_difference(saved, run_fingerprint(_model(hidden_size=64), None, None, RECIPE))
    assert words == "model config keys differ: 'head_dim' is 16 there, 32 here; 'hidden_size' is 32 there, 64 here"


STAGED = {"dataset": {"_target_": "a.b"}, "data.seq_length": 16, "step_scheduler.global_batch_size": 48,
          "model.freeze": ["embed"]}


def test_a_new_stage_may_change_the_data_the_sequence_length_and_the_batch_and_nothing_else() -> None:
    saved = _roundtrip(run_fingerprint(_model(), None, None, STAGED))
    staged = dict(STAGED, **{"dataset": {"_target_": "a.c"}, "data.seq_length": 64,
                             "step_scheduler.global_batch_size": 96})
    assert first_difference(saved, run_fingerprint(_model(), None, None, staged), STAGE_KEYS) is None
    assert first_difference(saved, run_fingerprint(_model(), None, None, staged)) is not None  # not a new stage
    frozen = dict(staged, **{"model.freeze": ["head"]})
    assert first_difference(saved, run_fingerprint(_model(), None, None, frozen), STAGE_KEYS) == \
        "recipe key 'model.freeze' is [\"embed\"] there, [\"head\"] here"
    assert first_difference(saved, run_fingerprint(_model(num_hidden_layers=2), None, None, staged), STAGE_KEYS) \
        .startswith("model config key 'num_hidden_layers'")


def _checkpoint(tmp_path, recipe, step=10, stages=None):
    ckpt = tmp_path / "run" / f"epoch_0_step_{step}"
    ckpt.mkdir(parents=True)
    meta = {"step": step, "fingerprint": _roundtrip(run_fingerprint(_model(), None, None, recipe))}
    (ckpt / "metadata.json").write_text(json.dumps(meta | ({"stages": stages} if stages else {})))
    return ckpt


def test_a_rerun_that_changes_a_stage_key_is_refused_in_one_line_naming_the_flag(tmp_path) -> None:
    ckpt = _checkpoint(tmp_path, STAGED)
    bigger = run_fingerprint(_model(), None, None, dict(STAGED, **{"step_scheduler.global_batch_size": 96}))
    with pytest.raises(CheckpointError) as err:
        check_same_run(ckpt, bigger, tmp_path / "run")
    said = str(err.value)
    assert "recipe key 'step_scheduler.global_batch_size' is 48 there, 96 here" in said
    assert "--checkpoint.new_stage NAME" in said and "\n" not in said
    check_same_run(ckpt, bigger, tmp_path / "run", lambda meta: (bigger, True))  # a new stage begins there
    other = run_fingerprint(_model(num_hidden_layers=2), None, None, STAGED)
    with pytest.raises(CheckpointError, match="is a checkpoint of another run: model config key"):
        check_same_run(ckpt, other, tmp_path / "run", lambda meta: (other, True))  # never the model
    with pytest.raises(CheckpointError, match="new_stage") as err:  # the stage rule's own fingerprint decides
        check_same_run(ckpt, _roundtrip(run_fingerprint(_model(), None, None, STAGED)), tmp_path / "run",
                       lambda meta: (bigger, meta["step"] != 10))
