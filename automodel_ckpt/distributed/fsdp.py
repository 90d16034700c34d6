"""FSDP2 / HSDP sharding of a causal LM (and an image-text model's vision tower), after tensor or expert parallelism."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from automodel_ckpt.distributed.expert_parallel import apply_expert_parallel, shard_experts
from automodel_ckpt.distributed.mesh import IMAGE_TEXT_EP_REFUSAL, IMAGE_TEXT_TP_REFUSAL, ParallelDims
from automodel_ckpt.distributed.tensor_parallel import apply_tensor_parallel, causal_lm, ties_embeddings
from automodel_ckpt.errors import ConfigError
from automodel_ckpt.model_parts import vision_tower

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


def decoder_layers(model: nn.Module, exclude: nn.Module | None = None) -> list[nn.Module]:
    """The repeated transformer blocks: the largest ``nn.ModuleList`` in the model outside ``exclude``."""
    inside = {id(m) for m in exclude.modules()} if exclude is not None else set()
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and id(m) not in inside]
    return list(max(lists, key=len)) if lists else []


def vocabulary_ends(model: nn.Module) -> list[nn.Module]:
    """The untied input embedding and output head, each its own FSDP2 unit (as torchtitan shards them)."""
    lm = causal_lm(model)
    if ties_embeddings(lm):
        return []
    ends = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        try:
            module = getattr(lm, getter)()
        except (AttributeError, NotImplementedError):
            continue
        if isinstance(module, nn.Module) and any(True for _ in module.parameters()):
            ends.append(module)
    return ends


def shard_model(model: nn.Module, mesh: DeviceMesh | ParallelDims, mixed_precision: str | None = None) -> nn.Module:
    """``fully_shard`` each decoder layer (and vision block), then the root: parameters gathered a block at a time.
    ``mesh``: a data-parallel mesh, or the run's ``ParallelDims``, whose tensor- and expert-parallel plans apply
    first."""
    experts: list[nn.Module] = []
    dims = mesh if isinstance(mesh, ParallelDims) else None
    if dims is not None:
        if (dims.tp_mesh is not None or dims.expert_mesh is not None) and vision_tower(model) is not None:
            raise ConfigError(IMAGE_TEXT_TP_REFUSAL if dims.tp_mesh is not None else IMAGE_TEXT_EP_REFUSAL)
        if dims.tp_mesh is not None:
            apply_tensor_parallel(model, dims.tp_mesh, dims.sizes.sequence_parallel)
        if dims.expert_mesh is not None:
            experts = apply_expert_parallel(model, dims.expert_mesh, dims.batch_mesh)
        mesh = dims.fsdp_mesh
    policy = mixed_precision_policy(mixed_precision)
    kwargs = {"mesh": mesh} | ({"mp_policy": policy} if policy is not None else {})
    if experts:
        shard_experts(experts, dims.expert_mesh, dims.dp_size, **{k: v for k, v in kwargs.items() if k != "mesh"})
    tower = vision_tower(model)
    recorded = _recorded_outputs(model)
    if tower is not None:
        for layer in decoder_layers(tower):
            fully_shard(layer, **kwargs)
        fully_shard(tower, **kwargs)
    for layer in decoder_layers(model, exclude=tower):
        if any(True for _ in layer.parameters()):  # a pipeline stage's other layers: parameterless placeholders
            fully_shard(layer, **kwargs)
    for end in vocabulary_ends(model):
        fully_shard(end, **kwargs)
        if isinstance(end, nn.Embedding):  # its backward reads the token ids, not the weight: not gathered there
            end.set_unshard_in_backward(False)
    fully_shard(model, **kwargs)
    if mesh.device_type == "cpu":  # a collective is done as it returns: memory buys no overlap (docs/large-models.md)
        for unit in (m for m in model.modules() if isinstance(m, FSDPModule)):
            unit.set_modules_to_backward_prefetch([unit])  # itself, gathered already: no block gathered ahead
            with contextlib.suppress(ValueError):  # a unit of several parameter groups (experts) keeps FSDP2's own
                unit.set_custom_reduce_scatter(_FreedReduceScatter())
    _restore_recorded_outputs(recorded)
    return model


class _FreedReduceScatter:
    """FSDP2's gradient reduce-scatter, its input freed as the call returns (FSDP2 keeps it until the next one's)."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        work = torch.distributed.reduce_scatter_single(output_tensor, input_tensor, op, group, async_op)
        if not async_op:
            input_tensor.untyped_storage().resize_(0)
        return work


def _recorded_outputs(model: nn.Module) -> list[tuple[nn.Module, dict]]:
    """Which outputs each transformers (sub)model can record, by class: under ``fully_shard``'s subclass
    transformers no longer finds them (a LLaVA vision tower would return no hidden states)."""
    try:
        from transformers.modeling_utils import PreTrainedModel
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
    except ImportError:  # a transformers without output capturing: nothing to keep
        return []
    return [(m, _CAN_RECORD_REGISTRY.get(m)) for m in model.modules() if isinstance(m, PreTrainedModel)
            and _CAN_RECORD_REGISTRY.get(m)]


def _restore_recorded_outputs(recorded: list[tuple[nn.Module, dict]]) -> None:
    if not recorded:
        return
    from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY

    for module, flags in recorded:
        _CAN_RECORD_REGISTRY[module] = flags


@contextlib.contextmanager
def gathered_between_forwards(model: nn.Module, budget: int | None = None) -> Iterator[None]:
    """Inside, FSDP2 blocks keep their gathered parameters after forward (sampling gathers each once, not once
    per token); after, all resharded. Nothing without FSDP2 blocks or past ``budget`` bytes of parameters."""
    if budget is not None and sum(p.numel() * p.element_size() for p in model.parameters()) > budget:
        yield
        return
    sharded = {name: m for name, m in model.named_modules() if isinstance(m, FSDPModule)}
    blocks = [m for name, m in sharded.items()  # inside another FSDP2 module: not a root
              if any(outer != name and (outer == "" or name.startswith(outer + ".")) for outer in sharded)]
    for block in blocks:
        block.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for block in blocks:
            block.reshard()
            block.set_reshard_after_forward(True, recurse=False)
