"""The ``dpo:`` section: its keys, their checks before training and its preview of pairs, registered as a section."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from automodel_ckpt.config.sections import AlgorithmSection
from automodel_ckpt.errors import ConfigError, expect

LOSSES = ("sigmoid", "ipo", "hinge", "simpo")
#: Losses with no reference model (SimPO compares the policy's own chosen and rejected log-probs).
REFERENCE_FREE = frozenset({"simpo"})


@dataclass
class DPOConfig:
    """Preference tuning (docs/preference.md): the loss, its reference model and the preference columns."""

    loss: str = "sigmoid"  # sigmoid (DPO) | ipo | hinge | simpo (reference-free, length-normalised)
    beta: float = 0.1  # strength of the KL penalty (simpo: the reward scale; 2.0 in the SimPO paper)
    label_smoothing: float = 0.0  # conservative DPO / robust SimPO: the share of labels assumed flipped, in [0, 0.5)
    simpo_gamma: float = 0.5  # simpo: the target reward margin, as gamma / beta on the log-prob difference
    rpo_alpha: Optional[float] = None  # RPO: add alpha x the chosen response's NLL per token (keeps chosen likely)
    sync_ref_model: bool = False  # TR-DPO: mix the policy into the reference every ref_model_sync_steps steps
    ref_model_sync_steps: int = 64  # steps between reference syncs
    ref_model_mixup_alpha: float = 0.6  # reference <- alpha * policy + (1 - alpha) * reference at each sync
    precompute_ref_log_probs: bool = False  # reference log-probs computed once, kept with the run; no reference in memory
    prompt_field: str = "prompt"  # the prompt column (a string, or chat messages)
    chosen_field: str = "chosen"  # the preferred response (a string, or chat messages ending with it)
    rejected_field: str = "rejected"  # the dispreferred response, like chosen


def check_dpo_section(dpo: Any, *, peft: bool) -> None:
    """Raise ConfigError (one line) for a ``dpo:`` value that would fail later."""
    expect(dpo.loss in LOSSES, "dpo.loss", f"one of {', '.join(LOSSES)}", dpo.loss)
    expect(dpo.beta > 0, "dpo.beta", "a positive number", dpo.beta)
    expect(0 <= dpo.label_smoothing < 0.5, "dpo.label_smoothing", "a value in [0, 0.5)", dpo.label_smoothing)
    rpo = dpo.get("rpo_alpha")
    expect(rpo is None or rpo >= 0, "dpo.rpo_alpha", "a number >= 0 or null", rpo)
    expect(dpo.ref_model_sync_steps >= 1, "dpo.ref_model_sync_steps", "a positive integer", dpo.ref_model_sync_steps)
    alpha = dpo.ref_model_mixup_alpha
    expect(0 < alpha <= 1, "dpo.ref_model_mixup_alpha", "a value in (0, 1]", alpha)
    reference_free = dpo.loss in REFERENCE_FREE
    if dpo.sync_ref_model and (peft or dpo.precompute_ref_log_probs or reference_free):
        why = ("a LoRA reference is the base with its adapters disabled, not a copy to mix into" if peft else
               "precomputed reference log-probs come from a reference that never changes"
               if dpo.precompute_ref_log_probs else f"dpo.loss {dpo.loss} uses no reference")
        raise ConfigError(f"dpo.sync_ref_model: cannot be used here: {why}; set dpo.sync_ref_model: false")
    if dpo.precompute_ref_log_probs and reference_free:
        raise ConfigError(f"dpo.precompute_ref_log_probs: dpo.loss {dpo.loss} uses no reference; set it to false")


def preview(cfg: Any, tokenizer: Any, *, num: int, split: str, color: bool) -> None:
    """``ckpt-train preview``: each pair's two responses."""
    from automodel_ckpt.data import prepare_pairs, preview_pairs

    preview_pairs(prepare_pairs(cfg, tokenizer), tokenizer, num=num, split=split, color=color)


SECTION = AlgorithmSection("dpo", DPOConfig, "preference tuning keys (recipe: automodel_ckpt.recipes.dpo.DPORecipe)",
                           check=lambda cfg, sizes: check_dpo_section(cfg.dpo, peft=cfg.get("peft") is not None),
                           preview=preview)
