"""Preference tuning (DPO, IPO, hinge, SimPO) of a causal LM: the fine-tune recipe with the preference algorithm."""

from __future__ import annotations

from automodel_ckpt.algorithms.dpo.algorithm import Preference
from automodel_ckpt.recipes.llm_finetune import FinetuneRecipe


class DPORecipe(FinetuneRecipe):
    """:class:`FinetuneRecipe` trained on preference pairs (``dpo:`` keys, docs/preference.md)."""

    algorithm_class = Preference
