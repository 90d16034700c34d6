"""A model's and its optimizer's state dicts as ``torch.distributed.checkpoint`` gives them, cheap to take again.

The first call asks torch and keeps its answer's layout; later ones lay out the live state the same way, asking
torch again whenever it no longer matches (a layout is kept only where it gives exactly torch's answer)."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.optim import Optimizer

_NEVER = object()  # torch's answer for this object cannot be rebuilt here: always ask torch
_MODELS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> _ModelLayout | _NEVER
_OPTIMIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> _OptimizerLayout | _NEVER


def model_state_dict(model: nn.Module) -> dict[str, Any]:
    """``get_model_state_dict(model)``."""
    layout = _MODELS.get(model)
    if isinstance(layout, _ModelLayout):
        state = layout.rebuild(model)
        if state is not None:
            return state
    state = get_model_state_dict(model)
    if layout is not _NEVER:
        _MODELS[model] = _ModelLayout.of(model, state)
    return state


def optimizer_state_dict(model: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """``get_optimizer_state_dict(model, optimizer)``."""
    layout = _OPTIMIZERS.get(optimizer)
    if isinstance(layout, _OptimizerLayout) and layout.model() is model:
        state = layout.rebuild(optimizer)
        if state is not None:
            return state
    state = get_optimizer_state_dict(model, optimizer)
    if layout is not _NEVER:
        _OPTIMIZERS[optimizer] = _OptimizerLayout.of(model, optimizer, state)
    return state


class _ModelLayout:
    """``model.state_dict()``'s keys and which torch's answer holds under which name, in its (own) order."""

    def __init__(self, keys: list[str], pairs: list[tuple[str, str]]) -> None:
        self.keys, self.pairs = keys, pairs

    @classmethod
    def of(cls, model: nn.Module, torch_state: dict[str, Any]) -> _ModelLayout | object:
        with torch.no_grad():
            raw = model.state_dict()
        if len(raw) != len(torch_state) or type(model).state_dict is not nn.Module.state_dict:
            return _NEVER
        renamed = iter([key for key in raw if key not in torch_state])
        pairs = [(name if name in raw else next(renamed, None), name) for name in torch_state]
        if any(key is None for key, _ in pairs):
            return _NEVER
        layout = cls(list(raw), pairs)
        rebuilt = layout.rebuild(model, raw)
        if rebuilt is None or list(rebuilt) != list(torch_state) or not all(
                same_value(rebuilt[k], v) for k, v in torch_state.items()):
            return _NEVER
        return layout

    def rebuild(self, model: nn.Module, raw: dict[str, Any] | None = None) -> dict[str, Any] | None:
        if raw is None:
            with torch.no_grad():
                raw = model.state_dict()
        if len(raw) != len(self.keys) or any(a != b for a, b in zip(raw, self.keys)):
            return None
        return {name: raw[key] for key, name in self.pairs}


class _OptimizerLayout:
    """The optimizer's parameters by group, the name torch gives each, and each group's keys, in order."""

    def __init__(self, model: nn.Module, params: list[tuple[torch.Tensor, ...]], names: list[list[str]],
                 group_keys: list[tuple[str, ...]]) -> None:
        self.model = weakref.ref(model)
        self.params, self.names, self.group_keys = params, names, group_keys
        self.name_of = {id(p): name for group, names_ in zip(params, names) for p, name in zip(group, names_)}

    @classmethod
    def of(cls, model: nn.Module, optimizer: Optimizer, torch_state: dict[str, Any]) -> _OptimizerLayout | object:
        groups, torch_groups = optimizer.param_groups, torch_state.get("param_groups")
        if (type(optimizer).state_dict is not Optimizer.state_dict or _has_hooks(optimizer)
                or not isinstance(torch_groups, list) or len(torch_groups) != len(groups)
                or set(torch_state) != {"state", "param_groups"}):
            return _NEVER
        names = [list(g.get("params", ())) for g in torch_groups]
        if any(len(n) != len(g["params"]) for n, g in zip(names, groups)):
            return _NEVER
        layout = cls(model, [tuple(g["params"]) for g in groups], names,
                     [tuple(k for k in g if k != "params") for g in groups])
        rebuilt = layout.rebuild(optimizer)
        if rebuilt is None or not _same_optimizer_state(rebuilt, torch_state):
            return _NEVER
        return layout

    def rebuild(self, optimizer: Optimizer) -> dict[str, Any] | None:
        groups = optimizer.param_groups
        if not optimizer.state or len(groups) != len(self.params):
            return None  # no state yet: torch makes it (``_init_optim_state``)
        packed = []
        for group, params, names, keys in zip(groups, self.params, self.names, self.group_keys):
            own = group["params"]
            if len(own) != len(params) or any(a is not b for a, b in zip(own, params)):
                return None
            entry = {k: v for k, v in group.items() if k != "params"}
            if tuple(entry) != keys:
                return None
            entry["params"] = list(names)
            packed.append(entry)
        state = {}
        for param, values in optimizer.state.items():
            name = self.name_of.get(id(param))
            if name is None:
                return None
            state[name] = values
        return {"state": state, "param_groups": packed}


def _has_hooks(optimizer: Optimizer) -> bool:
    return bool(getattr(optimizer, "_optimizer_state_dict_pre_hooks", None)
                or getattr(optimizer, "_optimizer_state_dict_post_hooks", None))


def same_value(a: Any, b: Any) -> bool:
    """The same tensor memory seen the same way (or the same plain value)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if type(a) is not type(b):
            return False
        if hasattr(a, "to_local"):
            if a.placements != b.placements or a.device_mesh != b.device_mesh:
                return False
            a, b = a.to_local(), b.to_local()
        return (a.data_ptr(), a.shape, a.stride(), a.dtype, a.device) == (b.data_ptr(), b.shape, b.stride(), b.dtype,
                                                                          b.device)
    try:
        return a is b or bool(a == b)
    except Exception:  # noqa: BLE001 - a value without a plain equality: not the same as far as this can tell
        return False


def _same_optimizer_state(rebuilt: dict[str, Any], torch_state: dict[str, Any]) -> bool:
    mine, theirs = rebuilt["state"], torch_state["state"]
    if list(mine) != list(theirs):
        return False
    for name, values in theirs.items():
        own = mine[name]
        if own is not values and (list(own) != list(values)
                                  or not all(same_value(own[k], v) for k, v in values.items())):
            return False
    for own, group in zip(rebuilt["param_groups"], torch_state["param_groups"]):
        if list(own) != list(group) or not all(same_value(own[k], v) for k, v in group.items()):
            return False
    return True
