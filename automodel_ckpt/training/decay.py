"""AdamW whose biases and norms take no weight decay: two parameter groups, as the Hugging Face Trainer makes them.

Its rule (decay for parameters of two or more dimensions) is the Trainer's for the usual transformers, so an
imported Trainer run continues with its own groups.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class AdamWNoDecay(torch.optim.AdamW):
    """``torch.optim.AdamW`` over two groups, with and without ``weight_decay`` (an empty group left out)."""

    def __init__(self, params: Iterable[torch.Tensor], weight_decay: float = 0.01, foreach: bool | None = None,
                 fused: bool | None = None, **kwargs: Any) -> None:
        params = list(params)
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        super().__init__([g for g in groups if g["params"]], weight_decay=weight_decay, foreach=foreach, fused=fused,
                         **kwargs)
