"""Online RL (GRPO) of a causal LM: the fine-tune recipe with an algorithm that samples, scores and learns."""

from __future__ import annotations

from automodel_ckpt.algorithms.grpo.algorithm import GRPO
from automodel_ckpt.recipes.llm_finetune import FinetuneRecipe


class GRPORecipe(FinetuneRecipe):
    """:class:`FinetuneRecipe` trained online (``grpo:`` keys, docs/rl.md)."""

    algorithm_class = GRPO
