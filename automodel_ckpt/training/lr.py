"""Learning-rate schedules built from the `lr_scheduler:` section."""

from __future__ import annotations

import math
from functools import partial

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


def _warmup_cosine_factor(step: int, *, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_cosine(optimizer: Optimizer, total_steps: int, warmup_steps: int = 10, min_lr_ratio: float = 0.1) -> LambdaLR:
    """Linear warmup to the optimizer's lr over ``warmup_steps``, then cosine decay to ``min_lr_ratio`` × lr.

    The factor is a ``functools.partial`` of a module function, so the scheduler's state_dict holds only numbers
    and loads with ``torch.load(weights_only=True)``.
    """
    factor = partial(_warmup_cosine_factor, warmup_steps=warmup_steps, total_steps=total_steps, min_lr_ratio=min_lr_ratio)
    return LambdaLR(optimizer, factor)


def constant(optimizer: Optimizer, total_steps: int) -> LambdaLR:
    return LambdaLR(optimizer, partial(_warmup_cosine_factor, warmup_steps=0, total_steps=total_steps, min_lr_ratio=1.0))
