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
    """The repeated transformer blocks: the largest ``nn.ModuleList`` in the model (``model.layers`` for Llama),
    outside ``exclude`` (a vision tower) if given."""
    inside = {id(m) for m in exclude.modules()} if exclude is not None else set()
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and id(m) not in inside]
    return list(max(lists, key=len)) if lists else []


def vocabulary_ends(model: nn.Module) -> list[nn.Module]:
    """The input embedding and the output head when untied, each to be its own FSDP2 unit (as torchtitan shards
    them): the root then no longer holds both gathered from the first forward to the end of the backward, nor the
    head's unsharded gradient through the whole backward. Tied, or where a model has neither: none."""
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
    """``fully_shard`` each decoder layer, then the root, so parameters are gathered one block at a time.

    An image-text model's vision tower is sharded the same way, each of its blocks, then the tower as a whole.
    ``mesh``: a data-parallel mesh, or the run's ``ParallelDims``: then its projections are first split over the
    tensor-parallel mesh by the family's plan, and ``fully_shard`` shards over the data-parallel mesh (with HSDP,
    the 2-D replicate × shard mesh: shard within a group, replicate across groups). With expert parallelism the
    experts are first spread over the expert mesh by the family's plan, and each experts module sharded over the
    copies of its experts (``expert_parallel.py``).
    """
    experts: list[nn.Module] = []
    dims = mesh if isinstance(mesh, ParallelDims) else None
    if dims is not None:
        if dims.tp_mesh is not None:
            if vision_tower(model) is not None:
                raise ConfigError(IMAGE_TEXT_TP_REFUSAL)
            apply_tensor_parallel(model, dims.tp_mesh, dims.sizes.sequence_parallel)
        if dims.expert_mesh is not None:
            if vision_tower(model) is not None:
                raise ConfigError(IMAGE_TEXT_EP_REFUSAL)
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
    fully_shard(model, **kwargs)
    _restore_recorded_outputs(recorded)
    return model


def _recorded_outputs(model: nn.Module) -> list[tuple[nn.Module, dict]]:
    """Which outputs (hidden states, attentions) each transformers (sub)model can record, keyed by its class.

    ``fully_shard`` swaps a module's class for an FSDP subclass, under which transformers no longer finds them:
    a LLaVA vision tower would then return no hidden states to pick its image features from.
    """
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
    """Inside: each FSDP2 block keeps its gathered parameters after its forward, so a run of forwards with no
    backward (sampling: one per new token) gathers each block once, not once per forward; after: every block
    resharded and back to resharding after each forward. The root is left as FSDP2 sets it (it keeps its own
    parameters gathered after forward anyway). Nothing to do for a model without FSDP2 blocks, or whose whole
    parameters would take more than ``budget`` bytes on a rank (then each forward gathers and reshards, as ever)."""
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
