"""Learning-rate schedules built from the `lr_scheduler:` section."""

from __future__ import annotations

import math
from functools import partial

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR, LRScheduler


def _warmup_cosine_factor(step: int, *, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_cosine(optimizer: Optimizer, total_steps: int, warmup_steps: int = 10, min_lr_ratio: float = 0.1) -> LambdaLR:
    """Linear warmup to the optimizer's lr over ``warmup_steps``, then cosine decay to ``min_lr_ratio`` × lr. The
    factor is a ``partial`` of a module function: the state_dict holds only numbers (``weights_only`` loads it)."""
    factor = partial(_warmup_cosine_factor, warmup_steps=warmup_steps, total_steps=total_steps, min_lr_ratio=min_lr_ratio)
    return LambdaLR(optimizer, factor)


def constant(optimizer: Optimizer, total_steps: int) -> LambdaLR:
    return LambdaLR(optimizer, partial(_warmup_cosine_factor, warmup_steps=0, total_steps=total_steps, min_lr_ratio=1.0))


def _wsd_factor(step: int, *, warmup_steps: int, total_steps: int, decay_steps: int, min_lr_ratio: float,
                decay: str) -> float:
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    start = total_steps - decay_steps
    if decay_steps <= 0 or step < start:
        return 1.0
    progress = min(1.0, (step - start) / decay_steps)
    shape = {"linear": progress, "sqrt": math.sqrt(progress), "cosine": 0.5 * (1.0 - math.cos(math.pi * progress))}
    return 1.0 - (1.0 - min_lr_ratio) * shape[decay]


def wsd(optimizer: Optimizer, total_steps: int, warmup_steps: int = 0, decay_steps: int = 0,
        decay_fraction: float = 0.0, min_lr_ratio: float = 0.0, decay: str = "linear") -> LambdaLR:
    """Warmup-stable-decay: ``warmup_cosine``'s warmup, then over the last ``decay_steps`` (or ``decay_fraction``;
    0: none, a later ``cooldown``'s) to ``min_lr_ratio`` × lr, by a line, ``sqrt`` or ``cosine``."""
    if decay not in ("linear", "sqrt", "cosine") or not 0.0 <= decay_fraction <= 1.0 or decay_steps < 0:
        raise ValueError("wsd: decay is linear, sqrt or cosine; decay_steps >= 0; decay_fraction in [0, 1]")
    steps = decay_steps or round(decay_fraction * total_steps)
    return LambdaLR(optimizer, partial(_wsd_factor, warmup_steps=warmup_steps, total_steps=total_steps,
                                       decay_steps=steps, min_lr_ratio=min_lr_ratio, decay=decay))


class Cooldown(LRScheduler):
    """Linear from each group's ``initial_lr`` to ``final_lr`` over ``steps`` (the recipe's, never a checkpoint's)."""

    _OWN = ("steps", "final_lr")

    def __init__(self, optimizer: Optimizer, steps: int, final_lr: float) -> None:
        self.steps, self.final_lr = steps, final_lr
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        done = min(max(self.last_epoch, 0), self.steps) / self.steps
        return [base + (self.final_lr - base) * done for base in self.base_lrs]

    def state_dict(self) -> dict:
        return {k: v for k, v in super().state_dict().items() if k not in self._OWN}

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict({k: v for k, v in state_dict.items() if k not in self._OWN})


def cooldown(optimizer: Optimizer, total_steps: int, steps: int, final_lr: float = 0.0) -> Cooldown:
    """An annealing stage's schedule (docs/stages.md): linear from the lr in force to ``final_lr`` over ``steps``."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1 or not math.isfinite(final_lr) \
            or final_lr < 0:
        raise ValueError("cooldown: steps is a whole number >= 1 and final_lr a finite lr >= 0")
    return Cooldown(optimizer, steps, float(final_lr))


# The HF Trainer's schedules are transformers' own (an import continues on its lrs, docs/import.md; warmup from 0),
# imported when used: transformers.optimization imports the Trainer's utilities and PEFT (a second of every launch).
# torch's are in closed form here: torch's step from their last value, which a resume cannot restore from the step.
def _cosine_annealing_factor(step: int, *, t_max: int, eta_min_ratio: float) -> float:
    return eta_min_ratio + (1.0 - eta_min_ratio) * (1.0 + math.cos(math.pi * step / t_max)) / 2.0


def _linear_ramp_factor(step: int, *, start_factor: float, end_factor: float, total_iters: int) -> float:
    return start_factor + (end_factor - start_factor) * min(step, total_iters) / max(1, total_iters)


def _step_decay_factor(step: int, *, step_size: int, gamma: float) -> float:
    return gamma ** (step // step_size)


def linear_decay(optimizer: Optimizer, total_steps: int, warmup_steps: int = 0) -> LambdaLR:
    """The HF Trainer's ``linear``: warmup from 0 over ``warmup_steps``, then linear decay to 0 at ``total_steps``."""
    from transformers.optimization import get_linear_schedule_with_warmup

    return get_linear_schedule_with_warmup(optimizer, warmup_steps, total_steps)


def cosine_decay(optimizer: Optimizer, total_steps: int, warmup_steps: int = 0, num_cycles: float = 0.5,
                 min_lr_rate: float = 0.0) -> LambdaLR:
    """The HF Trainer's ``cosine`` and ``cosine_with_min_lr``: warmup from 0, cosine to ``min_lr_rate`` × lr."""
    from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup

    return get_cosine_with_min_lr_schedule_with_warmup(optimizer, warmup_steps, total_steps, num_cycles=num_cycles,
                                                       min_lr_rate=min_lr_rate)


def constant_after_warmup(optimizer: Optimizer, total_steps: int, warmup_steps: int = 0) -> LambdaLR:
    """The HF Trainer's ``constant`` (no warmup) and ``constant_with_warmup``: warmup from 0, then the lr."""
    from transformers.optimization import get_constant_schedule_with_warmup

    return get_constant_schedule_with_warmup(optimizer, warmup_steps)


def cosine_annealing(optimizer: Optimizer, total_steps: int, t_max: int, eta_min_ratio: float = 0.0) -> LambdaLR:
    """torch's ``CosineAnnealingLR`` in closed form (``eta_min`` as a ratio of the lr)."""
    return LambdaLR(optimizer, partial(_cosine_annealing_factor, t_max=t_max, eta_min_ratio=eta_min_ratio))


def linear_ramp(optimizer: Optimizer, total_steps: int, start_factor: float = 1.0 / 3, end_factor: float = 1.0,
                total_iters: int = 5) -> LambdaLR:
    """torch's ``LinearLR``: the factor goes from ``start_factor`` to ``end_factor`` over ``total_iters`` steps."""
    return LambdaLR(optimizer, partial(_linear_ramp_factor, start_factor=start_factor, end_factor=end_factor,
                                       total_iters=total_iters))


def step_decay(optimizer: Optimizer, total_steps: int, step_size: int, gamma: float = 0.1) -> LambdaLR:
    """torch's ``StepLR``: the lr times ``gamma`` every ``step_size`` steps."""
    return LambdaLR(optimizer, partial(_step_decay_factor, step_size=step_size, gamma=gamma))


def _one_cycle_value(step: int, *, ends: list[float], values: list[float], anneal: str) -> float:
    """torch's ``OneCycleLR`` interpolation: phase ``i`` goes from ``values[i]`` to ``values[i + 1]`` until step
    ``ends[i]``, by half a cosine (``anneal`` "cos") or a line ("linear"); past the last end, its last value."""
    start = 0.0
    for i, end in enumerate(ends):
        if step <= end or i == len(ends) - 1:
            pct = min(1.0, (step - start) / (end - start))
            a, b = values[i], values[i + 1]
            if anneal == "cos":
                return b + (a - b) / 2.0 * (math.cos(math.pi * pct) + 1)
            return (b - a) * pct + a
        start = end
    raise ValueError("no phases")


class CyclingBeta1(LambdaLR):
    """A ``LambdaLR`` that also sets Adam's beta1 to ``beta1(step)`` at every step, as ``OneCycleLR`` with
    ``cycle_momentum`` does; the function is not part of its state (the optimizer's groups hold beta1)."""

    def __init__(self, optimizer: Optimizer, lr_lambda, beta1) -> None:
        self.beta1 = beta1
        super().__init__(optimizer, lr_lambda)

    def step(self, epoch: int | None = None) -> None:
        super().step(epoch)
        for group in self.optimizer.param_groups:
            group["betas"] = (self.beta1(self.last_epoch), *group["betas"][1:])

    def state_dict(self) -> dict:
        state = super().state_dict()
        state.pop("beta1", None)
        return state


def one_cycle(optimizer: Optimizer, total_steps: int, ends: list[float], factors: list[float], anneal: str = "cos",
              momenta: list[float] | None = None) -> LambdaLR:
    """torch's ``OneCycleLR``: phases ending at steps ``ends``, the lr going through ``factors`` × the optimizer's
    lr (its ``initial_lr``: ``max_lr / div_factor``) and, given ``momenta``, Adam's beta1 through them."""
    if anneal not in ("cos", "linear") or len(factors) != len(ends) + 1 or \
            (momenta is not None and len(momenta) != len(ends) + 1):
        raise ValueError("one_cycle: anneal is cos or linear, and factors (and momenta) hold one value more than ends")
    factor = partial(_one_cycle_value, ends=list(ends), values=list(factors), anneal=anneal)
    if momenta is None:
        return LambdaLR(optimizer, factor)
    return CyclingBeta1(optimizer, factor, partial(_one_cycle_value, ends=list(ends), values=list(momenta),
                                                   anneal=anneal))
