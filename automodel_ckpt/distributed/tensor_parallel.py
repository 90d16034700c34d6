"""Tensor parallelism from a model family's own plan (transformers' ``base_model_tp_plan``), applied with torch.

With torch's ``parallelize_module``; fused MoE experts stay whole on every rank (docs/parallelism.md).
"""

from __future__ import annotations

import logging
import warnings
from collections import defaultdict
from typing import Any, Callable, Iterable

import torch
from torch import nn

from automodel_ckpt.distributed.plan_paths import check_plan, module_paths
from automodel_ckpt.errors import ConfigError


def _styles() -> dict[str, Callable[[], Any]]:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    return {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),  # vocabulary rows split
        # a per-head norm's input is (..., this rank's heads, head_dim)
        "replicated_with_grad_allreduce": lambda: SequenceParallel(sequence_dim=-2, use_local_output=True),
    }


SUPPORTED_STYLES = ("colwise", "rowwise", "colwise_rep", "colwise_gather_output", "rowwise_split_input",
                    "embedding_rowwise", "replicated_with_grad_allreduce")
#: The style of a mixture-of-experts block's fused experts: they, and every plan entry under them, stay whole.
EXPERTS_STYLE = "moe_tp_experts"


def _text_config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    return getattr(config, "get_text_config", lambda: config)() if config is not None else None


def causal_lm(model: nn.Module) -> nn.Module:
    """The transformers model itself: the one a PEFT (LoRA) wrapper holds, else ``model``."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def ties_embeddings(model: nn.Module) -> bool:
    """Whether ``model``'s head shares the input embedding's weight (on a stage holding one: as its config says)."""
    try:
        out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return False
    weight, embedding = getattr(out, "weight", None), getattr(inp, "weight", None)
    if (weight is None) != (embedding is None):  # the first pipeline stage holds the embedding only: its config says
        return bool(getattr(_text_config(model), "tie_word_embeddings", False))
    return weight is not None and weight is embedding


def family_name(model: nn.Module) -> str:
    """The family as transformers names it (``model_type`` of the text config), else the model's class name."""
    return getattr(_text_config(model), "model_type", None) or type(model).__name__


def family_plan(model: nn.Module) -> dict[str, str]:
    """``{module path pattern: style}``: the plan transformers assembles for ``model`` (else the config's). Tied
    embeddings stay whole: the two styles would each make a parameter of the one shared weight."""
    return without_experts(_assembled_plan(model))


def _assembled_plan(model: nn.Module) -> dict[str, str]:
    """``family_plan`` with the fused experts' entries still in."""
    config = _text_config(model)
    base = dict(getattr(config, "base_model_tp_plan", None) or {})
    if not base:
        return {}
    plan = dict(getattr(model, "_tp_plan", None) or {})
    if not plan:
        prefix = getattr(model, "base_model_prefix", "") or ""
        plan = {(f"{prefix}.{k}" if prefix and hasattr(model, prefix) else k): v for k, v in base.items()}
    if ties_embeddings(model):
        shared = {id(model.get_input_embeddings()), id(model.get_output_embeddings())}
        names = {name for name, module in model.named_modules() if id(module) in shared}
        plan = {k: v for k, v in plan.items() if k not in names}
    return plan


def without_experts(plan: dict[str, str]) -> dict[str, str]:
    """``plan`` less the fused experts (``moe_tp_experts`` and every entry under it), which stay whole."""
    experts = [k for k, v in plan.items() if v == EXPERTS_STYLE]
    return {k: v for k, v in plan.items() if not any(k == e or k.startswith(f"{e}.") for e in experts)}


def _matching(model: nn.Module, pattern: str) -> list[nn.Module]:
    """The modules of ``model`` whose path matches ``pattern`` (``*``: one path segment)."""
    return [model.get_submodule(name) for name in module_paths(model, pattern)]


def check_tensor_parallel(model: nn.Module, tp_size: int) -> dict[str, str]:
    """The plan for ``model`` on ``tp_size`` ranks; one-line ``ConfigError`` when there is none or it cannot apply."""
    config = _text_config(model)
    family = family_name(model)
    if hasattr(model, "peft_config"):
        raise ConfigError("distributed.tp_size: LoRA with tensor parallelism is not supported yet; use tp_size 1 "
                          "(FSDP2 or HSDP shard the frozen base as well)")
    plan = family_plan(model)
    check_plan("tp_size", tp_size, family, plan, SUPPORTED_STYLES, kind="tensor-parallel",
               source="base_model_tp_plan in its transformers config")
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, key, None)
        if isinstance(heads, int) and heads % tp_size:
            raise ConfigError(f"distributed.tp_size {tp_size} does not divide {key} ({heads}) of the '{family}' "
                              "model; choose a tp_size that divides it")
    head_dim = getattr(config, "head_dim", None)
    for pattern in (k for k, v in plan.items() if v == "replicated_with_grad_allreduce"):
        shapes = {tuple(p.shape) for m in _matching(model, pattern) for p in m.parameters(recurse=False)}
        if head_dim is None or shapes - {(head_dim,)}:
            raise ConfigError(f"distributed.tp_size {tp_size}: the '{family}' plan replicates {pattern}, which is "
                              "not a per-head norm (one weight of head_dim); not supported yet, use tp_size 1")
    return plan


def parallel_styles(model: nn.Module, tp_size: int, sequence_parallel: bool = False) -> dict[str, Any]:
    """``{module path or pattern: torch style}`` that ``apply_tensor_parallel`` gives ``parallelize_module``."""
    plan = check_tensor_parallel(model, tp_size)
    styles = _styles()
    if sequence_parallel:
        from automodel_ckpt.distributed.sequence_parallel import sequence_parallel_plan

        experts = [k for k, v in _assembled_plan(model).items() if v == EXPERTS_STYLE]
        return sequence_parallel_plan(model, plan, experts, styles, family_name(model))
    # entries of modules this configuration has none of (a dense MLP's projections when every layer is sparse, the
    # embedding or head another pipeline stage holds: a parameterless placeholder here)
    return {pattern: styles[style]() for pattern, style in plan.items()
            if any(any(True for _ in m.parameters()) for m in _matching(model, pattern))}


def apply_tensor_parallel(model: nn.Module, tp_mesh: Any, sequence_parallel: bool = False) -> nn.Module:
    """Split ``model``'s projections over ``tp_mesh`` by its family's plan (checked by ``check_tensor_parallel``);
    with ``sequence_parallel``, also the activations between them along the sequence (``sequence_parallel.py``)."""
    from torch.distributed.tensor.parallel import parallelize_module

    styles = parallel_styles(model, tp_mesh.size(), sequence_parallel)
    # The head's gathered logits are a view; FSDP2 warns that an in-place change of the root's output would skip
    # its hooks. The loss never changes the logits in place.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    parallelize_module(model, tp_mesh, styles)
    return model


def _unclipped(total: torch.Tensor, limit: float) -> bool:
    """Whether ``clip_grads_with_norm_`` would scale by exactly 1 (its coefficient as it computes it, clamped): then
    it is skipped, bit for bit the same. On the CPU only (on an accelerator, asking waits for the device)."""
    return total.device.type == "cpu" and bool(torch.clamp(limit / (total + 1e-6), max=1.0) == 1.0)


def clip_grad_norm(parameters: Iterable[nn.Parameter], max_norm: float | None, stages: Any = None,
                   uncounted: Iterable[nn.Parameter] = ()) -> torch.Tensor:
    """``clip_grad_norm_`` over gradients on different meshes or pipeline stages (``stages``: their group): one
    total norm. ``uncounted``: scaled, not counted (a tied copy another stage counts). One mesh: torch's own."""
    params = [p for p in parameters if p.grad is not None]
    limit = max_norm if max_norm else float("inf")
    skipped = {id(p) for p in uncounted}
    groups: dict[Any, list[nn.Parameter]] = defaultdict(list)
    for p in params:
        groups[getattr(p.grad, "device_mesh", None)].append(p)
    if len(groups) <= 1 and stages is None and not skipped:  # torch's clip_grad_norm_, in its two parts
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        total = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        if not _unclipped(total, limit):
            torch.nn.utils.clip_grads_with_norm_(params, limit, norm)
        return total
    squares = []
    quiet = logging.getLogger("torch.distributed.tensor._redistribute")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # its hint to flatten the mesh for one all-reduce of a scalar norm
    try:
        for members in groups.values():
            counted = [p.grad for p in members if id(p) not in skipped]
            if not counted:
                continue
            norm = torch.nn.utils.get_total_norm(counted)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            squares.append(norm.double() ** 2)
    finally:
        quiet.setLevel(level)
    from torch.distributed.tensor.experimental import implicit_replication

    total = torch.stack([s.cpu() for s in squares]).sum() if squares else torch.zeros((), dtype=torch.float64)
    if stages is not None:  # each stage's squared norm, summed over the stages
        torch.distributed.all_reduce(total, group=stages)
    total = total.sqrt().float()
    if _unclipped(total, limit):
        return total
    with implicit_replication():  # the plain total scales DTensor gradients
        for members in groups.values():
            torch.nn.utils.clip_grads_with_norm_(members, limit, total.to(members[0].grad.device))
    return total
