"""A model every rank holds whole (replicated), saved as FSDP2's shards: each rank's slice of each tensor as a view.

No copy: every rank writes its own ``Shard(0)`` slice, and the files are those a sharded run writes."""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch import nn


def unchanged(state: dict) -> dict:
    return state


def model_shards(model: nn.Module) -> Callable[[dict], dict]:
    """What turns ``model``'s state dict into the state saved (for a replicated model, its shards' views), decided
    now: applying it needs no collective nor module, so a background save applies it in the background."""
    mesh = _replicated_mesh(model)
    if mesh is None:
        return unchanged
    params = frozenset(name for name, _ in model.named_parameters(remove_duplicate=False))
    return functools.partial(_params_as_shards, mesh=mesh, params=params)


def _params_as_shards(state: dict, *, mesh: Any, params: frozenset[str]) -> dict:
    return {k: _as_shards(v, mesh) if k in params else v for k, v in state.items()}


def optimizer_shards(model: nn.Module) -> Callable[[dict], dict]:
    """The same for an optimizer's state dict: a replicated model's moments as shards."""
    mesh = _replicated_mesh(model)
    return unchanged if mesh is None else functools.partial(_moments_as_shards, mesh=mesh)


def _moments_as_shards(state: dict, *, mesh: Any) -> dict:
    per_param = {fqn: {k: _as_shards(v, mesh) for k, v in values.items()} for fqn, values in state["state"].items()}
    return {**state, "state": per_param}


def _replicated_mesh(model: nn.Module):
    """The data-parallel mesh of a model every rank holds whole (replicated), or None (sharded, or one rank)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    params = list(model.parameters())
    if not params or any(isinstance(p, DTensor) for p in params):
        return None
    return _world_mesh(params[0].device.type, dist.get_world_size())


@functools.cache
def _world_mesh(device_type: str, world_size: int):
    """The 1-D mesh of every rank (over the default group: no new process group is made)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (world_size,))


def _as_shards(value: Any, mesh) -> Any:
    """A replicated tensor (1-D or more) as a view of this rank's FSDP2 ``Shard(0)`` of it, without a copy, made as
    ``DTensor.from_local`` makes it but from a placement worked out once per shape (``_shard_of``)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(value, torch.Tensor) or isinstance(value, DTensor) or value.dim() == 0:
        return value
    start, length, spec = _shard_of(value.shape, value.stride(), value.dtype, mesh)
    return DTensor(value.detach().narrow(0, start, length), spec, requires_grad=False)


@functools.lru_cache(maxsize=4096)
def _shard_of(shape: torch.Size, stride: tuple, dtype: torch.dtype, mesh: Any) -> tuple[int, int, Any]:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local, offset = compute_local_shape_and_global_offset(shape, mesh, (Shard(0),))
    return offset[0], local[0], DTensorSpec(mesh, (Shard(0),), tensor_meta=TensorMeta(shape, stride, dtype))
