"""Supervised fine-tuning of an image-text-to-text model (LLaVA, ...): the LLM recipe with the model's processor."""

from __future__ import annotations

from typing import Any

from automodel_ckpt.models.build import build_processor
from automodel_ckpt.recipes.llm_finetune import FinetuneRecipe


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
