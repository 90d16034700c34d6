"""Optimizer state created for loading without an optimizer step."""

from __future__ import annotations

import inspect

import torch

class _UninitialisedZeros(torch.overrides.TorchFunctionMode):
    """``zeros_like`` allocates without filling: the state it creates is about to be overwritten by the load."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.zeros_like:
            return torch.empty_like(*args, **kwargs)
        return func(*args, **kwargs)


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> bool:
    """Create the optimizer's state to load into without torch's ``step()`` on zero gradients: its own
    ``_init_group``, the moments allocated but not filled (the caller loads every value). False, changing
    nothing, where that does not create every parameter's state."""
    if optimizer.state:
        return True
    init_group = getattr(optimizer, "_init_group", None)
    if init_group is None:
        return False
    try:
        params = inspect.signature(init_group).parameters
    except (TypeError, ValueError):
        return False
    names = list(params)
    if not names or names[0] != "group" or any(p.default is not inspect.Parameter.empty
                                                or p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                                                for p in params.values()):
        return False
    wanted = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    saved = {p: p.grad for p in wanted}
    try:
        with torch.no_grad(), _UninitialisedZeros():
            for p in wanted:
                p.grad = torch.empty_like(p)  # never read: only its presence and shape matter
            for group in optimizer.param_groups:
                init_group(group, *[[] for _ in names[1:]])
    except Exception:  # noqa: BLE001 - any surprise: undo and let torch initialise by a step
        optimizer.state.clear()
        return False
    finally:
        for p, g in saved.items():
            p.grad = g
    if not all(optimizer.state.get(p) for p in wanted):
        optimizer.state.clear()
        return False
    return True

