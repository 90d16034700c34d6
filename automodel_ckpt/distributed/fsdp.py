"""FSDP2 sharding of a causal LM over a one-dimensional data-parallel mesh."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from automodel_ckpt.errors import ConfigError

_MP_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def data_parallel_mesh(device: torch.device, world_size: int) -> DeviceMesh:
    return init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",))


def mixed_precision_policy(name: str | None) -> MixedPrecisionPolicy | None:
    if name is None or str(name).lower() in ("none", "fp32", "float32", "no"):
        return None
    dtype = _MP_DTYPES.get(str(name).lower())
    if dtype is None:
        raise ConfigError(f"distributed.mixed_precision: expected bf16, fp16 or null, got '{name}'")
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks: the largest ``nn.ModuleList`` in the model (``model.layers`` for Llama)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def shard_model(model: nn.Module, mesh: DeviceMesh, mixed_precision: str | None = None) -> nn.Module:
    """``fully_shard`` each decoder layer, then the root, so parameters are gathered one block at a time."""
    policy = mixed_precision_policy(mixed_precision)
    kwargs = {"mesh": mesh} | ({"mp_policy": policy} if policy is not None else {})
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model
