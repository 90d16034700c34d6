"""Preference losses (DPO sigmoid, IPO, hinge, reference-free SimPO), their rewards, and the per-row log-probs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from automodel_ckpt.algorithms.dpo.config import LOSSES, REFERENCE_FREE
from automodel_ckpt.errors import ConfigError

#: The metrics summed over pairs (divided by the pair count when logged), in this order.
METRICS = ("loss", "reward_chosen", "reward_rejected", "reward_accuracy", "reward_margin")


@dataclass(frozen=True)
class PreferenceLoss:
    """``dpo.loss``, ``dpo.beta``, ``dpo.label_smoothing`` and ``dpo.simpo_gamma`` (docs/preference.md)."""

    loss: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    rpo_alpha: float | None = None

    @classmethod
    def from_section(cls, dpo: Any) -> "PreferenceLoss":
        rpo = dpo.get("rpo_alpha")
        return cls(str(dpo.loss), float(dpo.beta), float(dpo.label_smoothing), float(dpo.simpo_gamma),
                   None if rpo is None else float(rpo))

    @property
    def needs_reference(self) -> bool:
        return self.loss not in REFERENCE_FREE

    def __call__(self, chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor | None,
                 ref_rejected: torch.Tensor | None, chosen_tokens: torch.Tensor,
                 rejected_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(losses, chosen_rewards, rejected_rewards)`` per pair, as TRL's ``DPOTrainer`` and ``CPOTrainer`` define
        them (docs/preference.md's table); ``chosen``/``rejected``: summed log-probs of ``*_tokens`` tokens each."""
        beta, ls = self.beta, self.label_smoothing
        if self.loss == "simpo":
            chosen, rejected = chosen / chosen_tokens.clamp(min=1), rejected / rejected_tokens.clamp(min=1)
            logits = (chosen - rejected) - self.simpo_gamma / beta
            losses = -F.logsigmoid(beta * logits) * (1 - ls) - F.logsigmoid(-beta * logits) * ls
            return losses, beta * chosen.detach(), beta * rejected.detach()
        assert ref_chosen is not None and ref_rejected is not None
        chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
        logits = chosen_ratio - rejected_ratio
        if self.loss == "sigmoid":
            losses = -F.logsigmoid(beta * logits) * (1 - ls) - F.logsigmoid(-beta * logits) * ls
        elif self.loss == "ipo":
            per_token = chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(min=1)
            losses = (per_token - 1 / (2 * beta)) ** 2
        elif self.loss == "hinge":
            losses = torch.relu(1 - beta * logits)
        else:  # checked with the config
            raise ConfigError(f"dpo.loss: expected one of {', '.join(LOSSES)}, got '{self.loss}'")
        if self.rpo_alpha is not None:  # RPO: the chosen response's negative log-likelihood per token, added
            losses = losses - self.rpo_alpha * chosen / chosen_tokens.clamp(min=1)
        return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()

    def sums(self, losses: torch.Tensor, chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor,
             weight: torch.Tensor | None = None) -> torch.Tensor:
        """The ``METRICS`` summed over the pairs (``weight`` 0 leaves a pair out), float64, detached."""
        w = torch.ones_like(losses) if weight is None else weight.to(losses)
        rows = torch.stack([losses.detach(), chosen_rewards, rejected_rewards,
                            (chosen_rewards > rejected_rewards).to(losses), chosen_rewards - rejected_rewards])
        return (rows.double() * w.double()).sum(dim=1)


def response_log_probs(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Per row, the summed log-probability of its labelled tokens, each ``labels[:, t + 1]`` scored at
    ``logits[:, t]``; float32, with the gradient of the logits when they have one."""
    if hasattr(logits, "full_tensor"):  # tensor-parallel logits: the rows whole
        logits = logits.full_tensor()
    targets = labels[:, 1:]
    keep = targets != ignore_index
    flat = logits[:, :-1].flatten(0, 1).float()
    token = -F.cross_entropy(flat, targets.masked_fill(~keep, 0).flatten(), reduction="none").view(targets.shape)
    return (token * keep).sum(dim=1)
