"""A moving average of a model's trainable weights (``training.ema_decay``), in float32, sharded like them."""

from __future__ import annotations

import torch
from torch import nn

from automodel_ckpt.errors import ConfigError


class EMA(nn.Module):
    """``ema = decay * ema + (1 - decay) * weight`` for every trainable parameter, after each optimizer step.

    Each average is float32, placed as its parameter (a DTensor alike when sharded: DCP reshards it on a resume).
    Its state dict has the model's parameter names, so a checkpoint stores it as a model (``ema/``, exported with
    ``consolidate --ema``); a checkpoint without it (``checkpoint_optional``) leaves it to ``start`` from the weights.
    """

    checkpoint_optional = True  # a checkpoint of a run without EMA still resumes: the average starts there

    def __init__(self, model: nn.Module, decay: float) -> None:
        super().__init__()
        if not 0.0 < float(decay) < 1.0:
            raise ConfigError(f"training.ema_decay: expected a number between 0 and 1 (exclusive), got {decay}")
        self.decay = float(decay)
        self.names: list[str] = []
        self._averages: list[nn.Parameter] = []  # in ``names`` order
        for name, param in model.named_parameters():
            if not param.requires_grad:
                continue
            with torch.no_grad():  # a DTensor stays a DTensor (same mesh and placements), on the parameter's device
                average = torch.empty_like(param, dtype=torch.float32)
            kept = nn.Parameter(average, requires_grad=False)
            _place(self, name, kept)
            self.names.append(name)
            self._averages.append(kept)
        if not self.names:
            raise ConfigError("training.ema_decay: the model has no trainable parameter to average")

    def averages(self) -> list[torch.Tensor]:
        """The averages, in ``names`` order (their local shards when sharded)."""
        return [_local(p) for p in self._averages]

    def _weights(self, model: nn.Module) -> list[torch.Tensor]:
        params = dict(model.named_parameters())
        return [_local(params[name]) for name in self.names]

    @torch.no_grad()
    def start(self, model: nn.Module) -> None:
        """Set every average to its parameter's current value (a run's first step, or a checkpoint without EMA)."""
        for average, weight in zip(self.averages(), self._weights(model)):
            average.copy_(weight)

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """One step of the average, after an optimizer step: elementwise, the same on any number of ranks."""
        weights = [w if w.dtype == torch.float32 else w.float() for w in self._weights(model)]
        torch._foreach_lerp_(self.averages(), weights, 1.0 - self.decay)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _place(root: nn.Module, name: str, param: nn.Parameter) -> None:
    """Register ``param`` under the dotted ``name``, creating the empty modules on its path."""
    *path, leaf = name.split(".")
    module = root
    for part in path:
        child = module._modules.get(part)
        if child is None:
            child = nn.Module()
            module.add_module(part, child)
        module = child
    module.register_parameter(leaf, param)
