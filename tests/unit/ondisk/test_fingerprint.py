"""The run fingerprint: what changes a checkpoint's meaning is named, what may change between runs is not."""

from __future__ import annotations

import json

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from automodel_ckpt.ondisk.fingerprint import first_difference, run_fingerprint
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
