"""Supervised fine-tuning of an image-text-to-text model (LLaVA, ...): the LLM recipe with the model's processor."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from automodel_ckpt.models.build import build_processor
from automodel_ckpt.recipes.llm_finetune import FinetuneRecipe

logger = logging.getLogger(__name__)
_NO_VALUE_CHECKS = "TRANSFORMERS_DISABLE_TORCH_CHECK"


class VLMFinetuneRecipe(FinetuneRecipe):
    """:class:`FinetuneRecipe` for image + ``messages`` data (docs/vlm.md).

    The model comes from ``model:`` (``build_image_text_model``); the processor (image processor, tokenizer, chat
    template) from the tokenizer folder, by default the model's. The processor prepares every record's image,
    the chat template places its image tokens, and the checkpoint's Hugging Face files are the processor's, so
    an export loads with ``AutoModelForImageTextToText`` and ``AutoProcessor``. Training, checkpointing and
    resume are the LLM recipe's.
    """

    def load_tokenizer(self, path: str | None) -> Any:
        self.processor = build_processor(path)
        return self.processor.tokenizer

    def build_model_and_tokenizer(self) -> tuple[Any, torch.nn.Module]:
        tokenizer, model = super().build_model_and_tokenizer()
        unused = freeze_unused_parameters(model, self.processor)
        if unused and self.env.is_main:
            print(f"frozen: {len(unused)} parameter(s) the model's forward never uses ({', '.join(unused[:4])}"
                  f"{', ...' if len(unused) > 4 else ''})", flush=True)
        return tokenizer, model


def freeze_unused_parameters(model: torch.nn.Module, processor: Any) -> list[str]:
    """Stop training the parameters an image-text forward never reaches; returns their names.

    LLaVA-style models read image features from one hidden layer of the vision tower, so the tower's later layers
    and final norm get no gradient. The optimizer would then hold no state for them until some step gives them one,
    and a checkpoint's optimizer state would not cover the model. One probe forward and backward on a blank image
    finds them (every rank alike: the same model, the same probe).
    """
    from PIL import Image

    probe = processor(text=[processor.image_token + "a"], images=[Image.new("RGB", (64, 64))], return_tensors="pt")
    device = next(model.parameters()).device
    was_training = model.training
    model.train()
    # On the meta device (shapes and the graph only, all the probe needs) nothing may depend on a value: transformers'
    # checks of values (image tokens against image features) are turned off by its own switch, the probe's attention
    # mask (all ones) is left out and a cache is used, so that no mask is derived from values.
    meta = device.type == "meta"
    checks = os.environ.get(_NO_VALUE_CHECKS)
    if meta:
        os.environ[_NO_VALUE_CHECKS] = "1"
        probe.pop("attention_mask", None)
    try:
        out = model(**{k: v.to(device) for k, v in probe.items()}, use_cache=meta)
        out.logits.float().sum().backward()
    finally:
        model.train(was_training)
        if checks is None:
            os.environ.pop(_NO_VALUE_CHECKS, None)
        else:
            os.environ[_NO_VALUE_CHECKS] = checks
    unused = []
    for name, param in model.named_parameters():
        if param.requires_grad and param.grad is None:
            param.requires_grad_(False)
            unused.append(name)
        param.grad = None
    return unused
