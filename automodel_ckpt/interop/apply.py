"""A ``ForeignRun`` put into a recipe built as for training: weights, AdamW state, schedule, counters, data, RNG.

Everything is checked before anything is set: a tensor unaccounted for or of another shape is refused by name. What
differs from the source and changes the run (its global batch, its epoch length) is a line for ``say``.
"""

from __future__ import annotations

import math
from itertools import accumulate
from typing import Any, Callable

import torch

from automodel_ckpt.errors import ConfigError
from automodel_ckpt.interop import names, schedules
from automodel_ckpt.interop.source import MAX_STEPS, ForeignRun, refuse

MOMENTS = ("exp_avg", "exp_avg_sq")
_HYPER = ("lr", "betas", "eps", "weight_decay", "initial_lr")


def apply(run: ForeignRun, recipe: Any, where: str, say: Callable[[str], None]) -> dict[str, Any]:
    """Load ``run`` into ``recipe``; returns the counters of the checkpoint to write (step, epoch, loss,
    consumed_samples)."""
    model, optimizer = recipe.model, recipe.optimizer
    if not isinstance(optimizer, torch.optim.AdamW):
        raise ConfigError(f"optimizer._target_: the source's state is AdamW's; the recipe builds "
                          f"{type(optimizer).__name__} (use torch.optim.AdamW)")
    _check_adapter(run, model)
    if run.fit is not None:
        run.fit(model)
    params = dict(model.named_parameters())
    weights = _weights(run, model, params, where)
    state, group_of = _optimizer_state(run, model, params, where)
    members, hypers = _group_hypers(run, optimizer, model, group_of, where)
    schedules.check_recipe_schedule(run.schedule, recipe.lr_scheduler, recipe.step_scheduler.total_steps)
    lrs = [hyper["initial_lr"] * schedules.factor(run.schedule, run.step) for hyper in hypers]
    for lr, hyper in zip(lrs, hypers):
        if not math.isclose(lr, hyper["lr"], rel_tol=1e-6, abs_tol=1e-12):
            raise refuse(where, f"its optimizer's lr {hyper['lr']:.6g} at step {run.step} is not its schedule's "
                                f"({run.schedule.described}: {lr:.6g})")
    counters = _data_position(run, recipe, say)

    # checked: now set
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    recipe.starting_weights.fill(model, model_loaded=False)  # the base, under an adapter
    options = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(model, weights, options=options)
    groups = [{k: v for k, v in g.items() if k != "params"} | {k: hyper[k] for k in _HYPER} | {"params": names_in}
              for g, hyper, names_in in zip(optimizer.param_groups, hypers, members)]
    set_optimizer_state_dict(model, optimizer, {"state": state, "param_groups": groups}, options=options)
    sched = recipe.lr_scheduler.state_dict()
    sched.update(base_lrs=[hyper["initial_lr"] for hyper in hypers], last_epoch=run.step, _step_count=run.step + 1,
                 _last_lr=lrs)
    recipe.lr_scheduler.load_state_dict(sched)
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    recipe.step_scheduler.load_state_dict({"step": run.step, "epoch": counters["epoch"],
                                           "consumed_samples": counters["consumed_samples"]})
    recipe.dataloader.load_state_dict({"epoch": counters["epoch"], "position": counters["position"]})
    if run.rng is not None:
        recipe.rng.load_state_dict(run.rng)
    for record in run.log:
        recipe.train_log.append({"step": record["step"], "epoch": None, "loss": record["loss"], "lr": record["lr"],
                                 "grad_norm": record["grad_norm"]})
    last = [r["loss"] for r in run.log if r["step"] == run.step]
    return counters | {"step": run.step, "loss": last[-1] if last else None}


def _check_adapter(run: ForeignRun, model: Any) -> None:
    """A PEFT source into a recipe with the same ``peft:`` adapter (rank, alpha, scaling, targets), and only so."""
    ours = getattr(model, "peft_config", {}).get(names.ADAPTER) if hasattr(model, "peft_config") else None
    if run.adapter and ours is None:
        raise ConfigError("peft: the source is a LoRA adapter run; give the recipe a peft: section with its adapter "
                          "(rank, alpha, target_modules of its adapter_config.json)")
    if not run.adapter and ours is not None:
        raise ConfigError("peft: the source is a full fine-tune; the recipe's peft: section would train adapters "
                          "it has no state for")
    if ours is None or run.adapter_config is None:
        return
    theirs = run.adapter_config
    pairs = {"rank": (ours.r, theirs.get("r")), "alpha": (ours.lora_alpha, theirs.get("lora_alpha")),
             "use_rslora": (bool(ours.use_rslora), bool(theirs.get("use_rslora", False))),
             "target_modules": (sorted(ours.target_modules or []), sorted(theirs.get("target_modules") or []))}
    for key, (mine, source) in pairs.items():
        if mine != source and not (isinstance(mine, (int, float)) and isinstance(source, (int, float))
                                   and math.isclose(mine, source)):
            raise ConfigError(f"peft.{key}: the source's adapter has {source}, the recipe's {mine}")


def _weights(run: ForeignRun, model: Any, params: dict[str, Any], where: str) -> dict[str, torch.Tensor]:
    mapping = names.match_weights(model, list(run.weights), where, adapter=run.adapter)
    out = {}
    for ours, theirs in mapping.items():
        tensor, param = run.weights[theirs], params[ours]
        if tuple(tensor.shape) != tuple(param.shape):
            raise refuse(where, f"its weight '{theirs}' is {list(tensor.shape)}, the model's '{ours}' "
                                f"{list(param.shape)}: another model")
        out[ours] = tensor.to(param.dtype)
    return out


def _optimizer_state(run: ForeignRun, model: Any, params: dict[str, Any],
                     where: str) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, int]]:
    """AdamW's state under our names, and the source's param group of each name."""
    order = run.order(model)
    if len(order) != len(run.moments):
        raise refuse(where, f"its optimizer holds {len(run.moments)} parameters, the recipe's model trains "
                            f"{len(order)}: another model or another set of trainable parameters")
    starts = [0, *accumulate(g["count"] for g in run.groups)]
    group_of = {name: i for i, g in enumerate(run.groups) for name in order[starts[i]:starts[i] + g["count"]]}
    state = {}
    for slot, (name, moments) in enumerate(zip(order, run.moments)):
        param = params[name]
        if moments is None:
            raise refuse(where, f"its optimizer has no state for '{name}' (slot {slot})")
        missing = [k for k in ("step", *MOMENTS) if k not in moments]
        if missing:
            raise refuse(where, f"its optimizer's state for '{name}' (slot {slot}) has no {missing[0]}")
        extra = sorted(set(moments) - {"step", *MOMENTS})
        if extra:
            raise refuse(where, f"its optimizer's state for '{name}' holds '{extra[0]}', which AdamW here has not")
        for k in MOMENTS:
            if tuple(moments[k].shape) != tuple(param.shape):
                raise refuse(where, f"its {k} for '{name}' (slot {slot}) is {list(moments[k].shape)}, the parameter "
                                    f"{list(param.shape)}")
            if not moments[k].is_floating_point():
                raise refuse(where, f"its {k} for '{name}' is {moments[k].dtype}, not floating point")
        step = moments["step"]
        if step.numel() != 1 or not math.isfinite(float(step)) or not 0 <= float(step) <= MAX_STEPS:
            raise refuse(where, f"its step for '{name}' is not a count")
        state[name] = {"step": step.reshape(()).to(torch.float32), **{k: moments[k].to(param.dtype) for k in MOMENTS}}
    return state, group_of


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return math.isclose(float(a), float(b), rel_tol=1e-9)


def _group_hypers(run: ForeignRun, optimizer: Any, model: Any, group_of: dict[str, int],
                  where: str) -> tuple[list[list[str]], list[dict[str, Any]]]:
    """The names in each of the recipe's param groups, and the source's hyperparameters for each: those of the
    source group its parameters come from, which must agree in every one (a one-line refusal names two that do not)."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    members, hypers = [], []
    for index, group in enumerate(optimizer.param_groups):
        names_in = [name_of[id(p)] for p in group["params"]]
        missing = [n for n in names_in if n not in group_of]
        if missing:
            raise refuse(where, f"its optimizer has no state for '{missing[0]}'")
        members.append(names_in)
        if not names_in:
            hypers.append({k: run.groups[0][k] for k in _HYPER})
            continue
        first = names_in[0]
        hyper = {k: run.groups[group_of[first]][k] for k in _HYPER}
        for name in names_in[1:]:
            theirs = run.groups[group_of[name]]
            for k in _HYPER:
                if not _same(theirs[k], hyper[k]):
                    hint = (": optimizer._target_: automodel_ckpt.training.decay.AdamWNoDecay gives biases and norms a "
                            "group without weight decay, as the HF Trainer does") if k == "weight_decay" else ""
                    raise refuse(where, f"its parameter groups differ in {k}: '{first}' has {hyper[k]}, '{name}' "
                                        f"{theirs[k]}, and the recipe's optimizer puts both in its group {index}{hint}")
        hypers.append(hyper)
    return members, hypers


def _data_position(run: ForeignRun, recipe: Any, say: Callable[[str], None]) -> dict[str, int]:
    """The epoch, row position and samples consumed where the source stopped, for the recipe's map-style data."""
    loader = recipe.dataloader
    data = getattr(loader, "data", None)
    if data is None or not hasattr(loader, "position"):
        raise ConfigError("dataset: a streamed corpus has no sampler position to continue; import into a recipe "
                          "with map-style data")
    rows, ours = len(data), loader.global_batch_size
    batch = run.global_batch or ours
    epoch, taken, per_epoch = run.position(rows, batch)
    position = taken * batch
    for note in run.notes:
        say(note)
    if run.epoch_float is not None and per_epoch and \
            not math.isclose(run.epoch_float, epoch + taken / per_epoch, rel_tol=1e-6, abs_tol=1e-6):
        say(f"warning: data: the source was at epoch {run.epoch_float:g}, which the recipe's {rows} rows put at "
            f"{epoch + taken / per_epoch:g}: the recipe's data is not the source's, batches from step "
            f"{run.step + 1} differ from the source's")
    if batch != ours:
        say(f"Another global batch: the source took {batch} rows a step, the recipe takes {ours}: the "
            f"step count and schedule continue from step {run.step}, the data from row {position} of epoch {epoch}, "
            f"{ours} rows a step")
    elif per_epoch != rows // ours:
        say(f"Epoch length: the source's epochs take {per_epoch} steps (a partial last batch), the recipe's "
            f"{rows // ours} (it skips a partial batch): batches differ from epoch {epoch + 1} on")
    return {"epoch": epoch, "position": position, "consumed_samples": run.step * batch}
