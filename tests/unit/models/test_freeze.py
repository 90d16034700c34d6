"""``model.freeze`` resolved on real (tiny, meta-device) models: groups per family, globs, LoRA, refusals."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from automodel_ckpt.config.instantiate import check_arguments
from automodel_ckpt.errors import ConfigError
from automodel_ckpt.models.build import build_causal_lm
from automodel_ckpt.models.freeze import apply_freeze, check_freeze_section, parameter_line, resolve_freeze
from automodel_ckpt.models.tiny import TINY_LLAMA_CONFIG
from automodel_ckpt.models.tiny_vlm import tiny_llava_config


@pytest.fixture
def llava():
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    return LlavaForConditionalGeneration(LlavaConfig(**tiny_llava_config()))


@pytest.fixture
def llama():
    return build_causal_lm(config=dict(TINY_LLAMA_CONFIG, tie_word_embeddings=False), on_meta=True)


def _trainable(model) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


def test_vision_tower_group_freezes_the_tower_only(llava):
    names = apply_freeze(llava, ["vision_tower"])
    assert names and all(".vision_tower." in n for n in names)
    assert {n for n, _ in llava.named_parameters() if ".vision_tower." in n} == set(names)
    assert all(".vision_tower." not in n for n in _trainable(llava))
    assert any("multi_modal_projector" in n for n in _trainable(llava))  # the projector still trains


def test_groups_use_the_family_accessors(llava, llama):
    embed = resolve_freeze(llama, ["embeddings"])
    assert embed == ["model.embed_tokens.weight"]
    assert resolve_freeze(llama, ["lm_head"]) == ["lm_head.weight"]
    vlm_embed = resolve_freeze(llava, ["embeddings"])
    assert len(vlm_embed) == 1 and vlm_embed[0].endswith("embed_tokens.weight")
    language = set(resolve_freeze(llava, ["language_model"]))
    assert language and not any("vision_tower" in n or "multi_modal_projector" in n for n in language)
    assert "lm_head.weight" in language
    assert set(resolve_freeze(llama, ["language_model"])) == {n for n, _ in llama.named_parameters()}


def test_globs_and_module_names(llama):
    assert resolve_freeze(llama, ["model.layers.0"]) == [n for n, _ in llama.named_parameters()
                                                         if n.startswith("model.layers.0.")]
    norms = resolve_freeze(llama, ["*norm.weight"])
    assert norms and all(n.endswith("norm.weight") for n in norms)
    apply_freeze(llama, ["model.layers.*.self_attn", "embeddings"])
    assert not any("self_attn" in n or "embed_tokens" in n for n in _trainable(llama))
    assert any("mlp" in n for n in _trainable(llama))


def test_a_pattern_that_matches_nothing_is_one_line(llama):
    with pytest.raises(ConfigError) as err:
        apply_freeze(llama, ["embeddings", "model.layerz.*"])
    assert "model.freeze: 'model.layerz.*' matches nothing" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="'vision_tower' matches nothing: this model has no vision_tower"):
        apply_freeze(llama, ["vision_tower"])
    assert _trainable(llama) == {n for n, _ in llama.named_parameters()}  # refused before anything is frozen


def test_section_values_are_checked():
    assert check_freeze_section(None) == [] and check_freeze_section("lm_head") == ["lm_head"]
    assert check_freeze_section(OmegaConf.create({"f": ["vision_tower"]}).f) == ["vision_tower"]
    for bad in (3, [""], [1], {"a": 1}):
        with pytest.raises(ConfigError, match="model.freeze: expected"):
            check_freeze_section(bad)


def test_the_builder_never_sees_the_key():
    node = OmegaConf.create({"_target_": "automodel_ckpt.models.build.build_causal_lm", "freeze": ["lm_head"]})
    check_arguments(node, "model")  # the recipe's key, not the builder's
    with pytest.raises(ConfigError):
        check_arguments(OmegaConf.create({"_target_": "automodel_ckpt.models.build.build_causal_lm", "frieze": 1}),
                        "model")


def test_freeze_composes_with_lora(llava):
    from automodel_ckpt.config.schema import PeftConfig
    from automodel_ckpt.models.lora import apply_lora

    model = apply_lora(llava, PeftConfig(rank=4, vision_tower=False))
    adapters = _trainable(model)
    names = apply_freeze(model, ["vision_tower", "model.language_model.layers.0.self_attn.q_proj.base_layer"])
    assert _trainable(model) == adapters  # the base was frozen already: the adapters still train
    assert any("layers.0.self_attn.q_proj.base_layer" in n for n in names)  # matched without PEFT's prefix
    with pytest.raises(ConfigError, match=r"would freeze 2 LoRA adapter weight\(s\)"):  # never saved if frozen
        apply_freeze(model, ["model.language_model.layers.0.self_attn.q_proj"])
    assert _trainable(model) == adapters


def test_parameter_line_counts_a_tied_weight_once():
    tied = build_causal_lm(config=dict(TINY_LLAMA_CONFIG, tie_word_embeddings=True), on_meta=True)
    total = sum(p.numel() for p in tied.parameters())
    embed = tied.get_input_embeddings().weight.numel()
    apply_freeze(tied, ["lm_head"])  # the head is the embedding: both frozen
    line = parameter_line(tied, ["lm_head"])
    assert line.startswith("Parameters: ") and "(model.freeze: lm_head)" in line
    assert f"({total - embed:,}) trainable" in line or f"{total - embed} trainable" in line
    assert f"({embed:,}) frozen" in line or f"{embed} frozen" in line
