"""Online RL (GRPO) of a causal LM: the fine-tune recipe with an algorithm that samples, scores and learns.

``GRPO`` (``algorithms/grpo/``) samples each rollout batch from the policy, scores it and takes the clipped-ratio
loss over it; the rest is ``FinetuneRecipe``'s.
"""

from __future__ import annotations

from automodel_ckpt.algorithms.grpo.algorithm import GRPO
from automodel_ckpt.recipes.llm_finetune import FinetuneRecipe


class GRPORecipe(FinetuneRecipe):
    """:class:`FinetuneRecipe` trained online (``grpo:`` keys, docs/rl.md): its algorithm is :class:`GRPO`, whose
    state (``grpo``, ``rollout``, ``ref_model``) is checkpointed beside the fine-tune's."""

    algorithm_class = GRPO
