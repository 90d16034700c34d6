"""Embedded vision-language base: a tiny LLaVA (CLIP vision tower + Llama) with a locally built processor."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from automodel_ckpt.models.tiny import BASE_SEED, TINY_LLAMA_CONFIG, _deterministic_init, _shard_limit
from automodel_ckpt.models.tiny import build_tokenizer as build_text_tokenizer
from automodel_ckpt.models.tiny import ensure_model_folder, name_generic_tokenizer

__all__ = ["IMAGE_SIZE", "IMAGE_TOKEN", "NUM_IMAGE_TOKENS", "VLM_CHAT_TEMPLATE", "build_processor",
           "ensure_tiny_vlm_base", "tiny_llava_config"]

#: The placeholder the chat template writes for an image; the processor expands it to one token per patch.
IMAGE_TOKEN: str = "<image>"

#: Side of the (square) images the vision tower sees, in pixels, and of one patch.
IMAGE_SIZE: int = 32
PATCH_SIZE: int = 8

#: Image tokens per image: one per patch (the CLIP class token is dropped, LLaVA's "default" strategy).
NUM_IMAGE_TOKENS: int = (IMAGE_SIZE // PATCH_SIZE) ** 2

#: The embedded tokenizer's chat template, with ``{"type": "image"}`` content items rendered as :data:`IMAGE_TOKEN`.
VLM_CHAT_TEMPLATE: str = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] + ': ' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}{{ '" + IMAGE_TOKEN + "' }}"
    "{% else %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ ' ' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)

_MAX_POSITIONS = 128


def build_vlm_tokenizer() -> Any:
    """The embedded character-level tokenizer plus :data:`IMAGE_TOKEN` as one special token (the last id)."""
    tokenizer = build_text_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tokenizer.model_max_length = _MAX_POSITIONS
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    return tokenizer


def build_processor() -> Any:
    """``LlavaProcessor``: a CLIP image processor at :data:`IMAGE_SIZE` pixels and the VLM tokenizer."""
    from transformers import CLIPImageProcessor, LlavaProcessor

    image_processor = CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        do_center_crop=True, do_resize=True, do_normalize=True, do_convert_rgb=True)
    return LlavaProcessor(image_processor=image_processor, tokenizer=build_vlm_tokenizer(),
                          patch_size=PATCH_SIZE, vision_feature_select_strategy="default",
                          image_token=IMAGE_TOKEN, num_additional_image_tokens=1,
                          chat_template=VLM_CHAT_TEMPLATE)


def tiny_llava_config() -> dict[str, Any]:
    """``LlavaConfig`` keyword arguments of the embedded VLM base (about 0.8M parameters)."""
    tokenizer = build_vlm_tokenizer()
    text = dict(TINY_LLAMA_CONFIG, vocab_size=len(tokenizer), max_position_embeddings=_MAX_POSITIONS)
    text["model_type"] = "llama"
    vision = {
        "model_type": "clip_vision_model", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 2, "image_size": IMAGE_SIZE, "patch_size": PATCH_SIZE, "num_channels": 3,
        "projection_dim": 64, "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5,
    }
    return {
        "text_config": text, "vision_config": vision,
        "image_token_index": tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        "projector_hidden_act": "gelu", "vision_feature_select_strategy": "default", "vision_feature_layer": -1,
        "image_seq_length": NUM_IMAGE_TOKENS, "tie_word_embeddings": False,
        "bos_token_id": text["bos_token_id"], "eos_token_id": text["eos_token_id"], "pad_token_id": text["pad_token_id"],
    }


def _write_base(folder: Path) -> None:
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    config = LlavaConfig(**tiny_llava_config())
    config._attn_implementation = "eager"
    model = LlavaForConditionalGeneration(config)
    _deterministic_init(model, seed=BASE_SEED, std=TINY_LLAMA_CONFIG["initializer_range"])
    with torch.no_grad():  # every norm (CLIP's layer norms too): weight one, bias zero, as in the reference init
        for name, param in model.named_parameters():
            if "norm" in name.rsplit(".", 2)[-2]:
                param.fill_(1.0 if name.endswith(".weight") else 0.0)
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    # the layout of the Hub's LLaVA folders, which vLLM reads (``vision_tower.vision_model.*``), as save_pretrained
    # writes a model loaded from one
    from transformers.conversion_mapping import get_model_conversion_mapping

    model._weight_conversions = get_model_conversion_mapping(model, add_legacy=False)  # noqa: SLF001
    model.save_pretrained(folder, max_shard_size=_shard_limit(model))
    if len(list(folder.glob("*.safetensors"))) != 2:
        raise RuntimeError(f"expected two weight shards in {folder}")
    build_processor().save_pretrained(folder)
    name_generic_tokenizer(folder)


def ensure_tiny_vlm_base(path: str | os.PathLike[str]) -> Path:
    """``path`` holding the embedded VLM base (``llava``, with the processor's files), created as the text base is."""
    return ensure_model_folder(path, _write_base)
