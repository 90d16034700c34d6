"""Discovers a recipe's checkpointed state: every attribute with both `state_dict` and `load_state_dict`.

Public attributes only, less ``checkpoint_exclude``, each stored by what it is (docs/checkpointing.md); a module with
``checkpoint_optional = True`` is skipped on restore when the checkpoint lacks it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from torch import nn
from torch.optim import Optimizer

_MODEL = "model"
_OPTIMIZER = "optimizer"
_RANK = "rank"
_GLOBAL = "global"


def _has_state(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def discover_state(owner: Any, exclude: Iterable[str] = ()) -> dict[str, Any]:
    """``{attribute name: object}`` of ``owner``'s checkpointed state, in attribute definition order."""
    skip = set(exclude)
    return {
        name: value
        for name, value in vars(owner).items()
        if not name.startswith("_") and name not in skip and _has_state(value)
    }


def _kind_of(value: Any) -> str:
    if isinstance(value, nn.Module):
        return _MODEL
    if isinstance(value, Optimizer):
        return _OPTIMIZER
    return _RANK if getattr(value, "checkpoint_scope", _GLOBAL) == _RANK else _GLOBAL


@dataclass
class StatePlan:
    """Discovered state grouped by how it is stored, once per save; ``model_for`` pairs an optimizer with its model."""

    models: dict[str, nn.Module]
    optimizers: dict[str, Optimizer]
    per_rank: dict[str, Any]
    global_: dict[str, Any]

    def objects(self) -> list[Any]:
        """Every object of the plan (a save that runs out of room reports their size)."""
        return [*self.models.values(), *self.optimizers.values(), *self.per_rank.values(), *self.global_.values()]

    def model_for(self, optimizer_name: str) -> nn.Module:
        """The one model, or with several (a policy and its reference) the one named ``model``."""
        if len(self.models) > 1 and _MODEL in self.models:
            return self.models[_MODEL]
        if len(self.models) != 1:
            raise ValueError(
                f"optimizer '{optimizer_name}' needs exactly one checkpointed nn.Module to pair with, "
                f"found {sorted(self.models) or 'none'}"
            )
        return next(iter(self.models.values()))


def plan_state(states: dict[str, Any]) -> StatePlan:
    plan = StatePlan({}, {}, {}, {})
    groups = {_MODEL: plan.models, _OPTIMIZER: plan.optimizers, _RANK: plan.per_rank, _GLOBAL: plan.global_}
    for name, value in states.items():
        groups[_kind_of(value)][name] = value
    return plan
