"""Preference tuning (DPO, IPO, hinge, SimPO) of a causal LM: the fine-tune recipe with the preference algorithm.

``Preference`` (``algorithms/dpo/``) brings the pairs, the pair loss, the reference and the counters. Everything
else is ``FinetuneRecipe``'s: the CLI, launcher, meshes, formats, async saves, node-local tier, object storage,
trackers, ``restore_from`` and the export of the policy.
"""

from __future__ import annotations

from automodel_ckpt.algorithms.dpo.algorithm import Preference
from automodel_ckpt.recipes.llm_finetune import FinetuneRecipe


class DPORecipe(FinetuneRecipe):
    """:class:`FinetuneRecipe` trained on preference pairs (``dpo:`` keys, docs/preference.md): its algorithm is
    :class:`Preference`, whose state (``dpo``, ``ref_model``) is checkpointed beside the fine-tune's."""

    algorithm_class = Preference
