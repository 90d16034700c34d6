"""Supervised fine-tuning of an image-text-to-text model (LLaVA, ...): the LLM recipe with the model's processor."""

from __future__ import annotations

import os
from typing import Any
from unittest import mock

import torch

from automodel_ckpt.models.build import build_processor
from automodel_ckpt.recipes.llm_finetune import FinetuneRecipe

_NO_VALUE_CHECKS = "TRANSFORMERS_DISABLE_TORCH_CHECK"


class VLMFinetuneRecipe(FinetuneRecipe):
    """:class:`FinetuneRecipe` for image + ``messages`` data (docs/vlm.md): the processor, from the tokenizer folder,
    prepares every image and is saved with the checkpoint, so an export loads with ``AutoProcessor``."""

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
    """Stop training the parameters an image-text forward never reaches (a LLaVA tower's layers after the one it
    reads), whose optimizer state would otherwise be missing; found by one probe on a blank image. Their names."""
    from PIL import Image

    probe = processor(text=[processor.image_token + "a"], images=[Image.new("RGB", (64, 64))], return_tensors="pt")
    device = next(model.parameters()).device
    was_training = model.training
    model.train()
    # on the meta device nothing may depend on a value: transformers' value checks off, no mask, a cache used
    meta = device.type == "meta"
    if meta:
        probe.pop("attention_mask", None)
    try:
        with mock.patch.dict(os.environ, {_NO_VALUE_CHECKS: "1"} if meta else {}):  # restored after
            out = model(**{k: v.to(device) for k, v in probe.items()}, use_cache=meta)
            out.logits.float().sum().backward()
    finally:
        model.train(was_training)
    unused = []
    for name, param in model.named_parameters():
        if param.requires_grad and param.grad is None:
            param.requires_grad_(False)
            unused.append(name)
        param.grad = None
    return unused
