"""AdamW whose biases and norms take no weight decay: two parameter groups, as the Hugging Face Trainer makes them.

``optimizer._target_: automodel_ckpt.training.decay.AdamWNoDecay`` puts the parameters of two or more dimensions
(weights, embeddings) in a group with the recipe's ``weight_decay`` and those of fewer (biases, norm scales) in a
group without. For the usual transformer models that is the HF Trainer's rule (``get_decay_parameter_names``: no
decay for biases and the parameters of norm layers), so an imported Trainer run with ``weight_decay > 0`` continues
with its own groups (``interop.apply`` checks each parameter's group by name). Everything else is torch's AdamW.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class AdamWNoDecay(torch.optim.AdamW):
    """``torch.optim.AdamW`` over two groups: parameters of 2+ dimensions with ``weight_decay``, the rest without
    (a group left empty is left out)."""

    def __init__(self, params: Iterable[torch.Tensor], weight_decay: float = 0.01, foreach: bool | None = None,
                 fused: bool | None = None, **kwargs: Any) -> None:
        params = list(params)
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        super().__init__([g for g in groups if g["params"]], weight_decay=weight_decay, foreach=foreach, fused=fused,
                         **kwargs)
