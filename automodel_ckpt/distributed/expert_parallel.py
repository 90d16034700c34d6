"""Expert parallelism from a model family's own plan (transformers' ``base_model_ep_plan``), under FSDP2.

transformers' own styles; parameters keep whole-model names and global shapes (docs/parallelism.md).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from automodel_ckpt.distributed.plan_paths import check_plan, module_paths
from automodel_ckpt.distributed.tensor_parallel import causal_lm, family_name
from automodel_ckpt.errors import ConfigError

#: The styles of an expert plan applied here (transformers' ``MoEParamShard`` and ``EpDispatchExpertsParallel``).
SUPPORTED_STYLES = ("grouped_gemm", "ep_dispatch_experts")
DISPATCH = "ep_dispatch_experts"


def expert_plan(model: nn.Module) -> dict[str, str]:
    """``{path pattern: style}``: the plan transformers assembles for ``model``; empty without experts."""
    return dict(getattr(model, "ep_plan", None) or {})


def _expanded(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """``plan`` with its patterns replaced by the model's parameter and module paths: the expert weights first (their
    sharding sets the local expert count), then the modules that dispatch to them."""
    weights, modules = {}, {}
    for pattern, style in plan.items():
        if style == DISPATCH:
            modules.update(dict.fromkeys(module_paths(model, pattern), style))
            continue
        owner, _, name = pattern.rpartition(".")
        for path in module_paths(model, owner):
            if name in model.get_submodule(path)._parameters:
                weights[f"{path}.{name}"] = style
    return weights | modules


def check_expert_parallel(model: nn.Module, ep_size: int) -> dict[str, str]:
    """The expanded plan for ``model`` on ``ep_size`` ranks; ``ConfigError`` when there is none or it cannot apply."""
    model = causal_lm(model)
    family = family_name(model)
    plan = expert_plan(model)
    check_plan("ep_size", ep_size, family, plan, SUPPORTED_STYLES, kind="expert-parallel", named="expert ",
               source="base_model_ep_plan in its transformers config: no experts to spread")
    expanded = _expanded(model, plan)
    dispatchers = [path for path, style in expanded.items() if style == DISPATCH]
    if not dispatchers:
        raise ConfigError(f"distributed.ep_size {ep_size}: this '{family}' model has no mixture-of-experts layer "
                          "(every layer dense); use ep_size 1")
    for path in dispatchers:
        module = model.get_submodule(path)
        whole = sorted(n for n, _ in module.named_parameters(recurse=False) if f"{path}.{n}" not in expanded)
        experts = getattr(module, "num_experts", None)
        if whole or not isinstance(experts, int):
            what = f"leaves {', '.join(whole)} whole" if whole else "has no expert count (num_experts)"
            raise ConfigError(f"distributed.ep_size {ep_size}: the '{family}' expert plan {what} in {path}, which "
                              "expert parallelism cannot split; use ep_size 1")
        if experts % ep_size:
            raise ConfigError(f"distributed.ep_size {ep_size} does not divide the {experts} experts of the "
                              f"'{family}' model ({path}); choose an ep_size that divides them")
    return expanded


def apply_expert_parallel(model: nn.Module, expert_mesh: Any, batch_mesh: Any) -> list[nn.Module]:
    """Spread the experts of ``model`` (meta device, before ``fully_shard``) over ``expert_mesh["ep"]``; returns
    the modules that dispatch tokens to them. ``batch_mesh``: the ranks that hold the same rows."""
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    model = causal_lm(model)
    plan = check_expert_parallel(model, expert_mesh["ep"].size())
    # tokens reach their experts with all-to-all (transformers' AllToAllEP), each token sent once
    apply_expert_parallelism(model, expert_mesh["ep"], batch_mesh, plan, ep_implementation="all_to_all")
    return [model.get_submodule(path) for path, style in plan.items() if style == DISPATCH]


def shard_experts(experts: list[nn.Module], expert_mesh: Any, dp_size: int, **fsdp_kwargs: Any) -> None:
    """``fully_shard`` each experts module over the experts' copies (``efsdp``), before its decoder layer. Its
    gradient sums the whole global batch (the all-to-all's backward, then the copies), so it is divided by the
    data-parallel size, not the number of copies (applied locally: gloo has no pre-multiplied sum)."""
    from torch.distributed.fsdp import fully_shard

    names = expert_mesh.mesh_dim_names
    copies = expert_mesh[("dp_replicate", "efsdp")] if "dp_replicate" in names else expert_mesh["efsdp"]
    for module in experts:
        fully_shard(module, mesh=copies, **fsdp_kwargs)
        module.set_gradient_divide_factor(float(dp_size))
        if expert_mesh["efsdp"].size() > 1:  # summed over the copies, then divided (one copy: FSDP2 divides itself)
            module.set_force_sum_reduction_for_comms(True)
