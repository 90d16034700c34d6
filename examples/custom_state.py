"""A recipe subclass with its own checkpointed state: add an attribute with state_dict/load_state_dict.

Run it like the default recipe, naming the class with --recipe:

    ckpt-train --nproc-per-node=2 recipes/tiny_llama_sft.yaml --recipe examples/custom_state.py:TokenCountingRecipe

Every checkpoint then also holds ``token_counter.pt``, and a resumed run continues the count.
"""

from __future__ import annotations

from typing import Any

from automodel_ckpt.recipes.llm_finetune import FinetuneRecipe


class TokenCounter:
    """Counts optimizer steps and training tokens seen; saved as ``token_counter.pt`` in every checkpoint."""

    def __init__(self) -> None:
        self.steps = 0
        self.tokens = 0

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "tokens": self.tokens}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.steps = state_dict["steps"]
        self.tokens = state_dict["tokens"]


class TokenCountingRecipe(FinetuneRecipe):
    def setup(self) -> None:
        super().setup()
        self.token_counter = TokenCounter()  # discovered automatically: nothing else to register

    def train_step(self, micro):
        loss, grad_norm, tokens = super().train_step(micro)
        self.token_counter.steps += 1
        self.token_counter.tokens += int(tokens)
        return loss, grad_norm, tokens
