"""Another trainer's learning-rate schedule as one of ours (``training/lr.py``), and the check that a recipe has it.

A source's scheduler file holds its position, not its formula: that comes from the HF Trainer's arguments or a torch
scheduler's state. The recipe's ``lr_scheduler`` decides the schedule on every resume, so its factor must be the
source's at every step up to the end.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any, Callable

from automodel_ckpt.errors import ConfigError
from automodel_ckpt.interop.source import (MAX_SCHEDULE_STEPS, MAX_STEPS, Schedule, count, fraction, number,
                                           refuse)
from automodel_ckpt.shown import one_line, shown_value

_LR = "automodel_ckpt.training.lr"


def from_hf_trainer(args: dict[str, Any], total_steps: int) -> Schedule:
    """The HF Trainer's ``lr_scheduler_type`` with its warmup (from lr 0, as the Trainer does) over ``total_steps``;
    ``args``: the Trainer's arguments as ``trainer_args.checked`` returns them (each of its type and range)."""
    kind = args.get("lr_scheduler_type")
    warmup = args.get("warmup_steps") or 0
    if isinstance(warmup, float) and warmup < 1:  # a ratio, as the Trainer reads it (get_warmup_steps)
        warmup = math.ceil(total_steps * warmup)
    elif not warmup and args.get("warmup_ratio"):
        warmup = math.ceil(total_steps * args["warmup_ratio"])
    warmup = int(warmup)
    extra = args.get("lr_scheduler_kwargs") or {}
    lr = args.get("learning_rate") or 0.0
    described = f"HF Trainer '{kind}' (warmup {warmup} steps, {total_steps} steps)"
    if kind == "linear":
        return Schedule(described, f"{_LR}.linear_decay", {"warmup_steps": warmup}, total_steps)
    if kind in ("constant", "constant_with_warmup"):
        return Schedule(described, f"{_LR}.constant_after_warmup",
                        {"warmup_steps": warmup if kind == "constant_with_warmup" else 0}, total_steps)
    if kind in ("cosine", "cosine_with_min_lr"):
        cycles = float(extra.get("num_cycles", 0.5))  # checked: a finite number >= 0
        rate = 0.0
        if kind == "cosine_with_min_lr":
            if extra.get("min_lr") is not None:
                rate = extra["min_lr"] / lr if lr else 0.0
            else:
                rate = float(extra.get("min_lr_rate", 0.0))
            if not math.isfinite(rate):
                return Schedule(described, None, why_not="the HF Trainer's min_lr over its learning_rate is no finite "
                                                         "rate")
        return Schedule(described, f"{_LR}.cosine_decay",
                        {"warmup_steps": warmup, "num_cycles": cycles, "min_lr_rate": rate}, total_steps)
    return Schedule(described, None, why_not=f"the HF Trainer's '{kind}' schedule has no counterpart here "
                                             "(linear, cosine, cosine_with_min_lr, constant and "
                                             "constant_with_warmup do)")


def from_torch_state(state: dict[str, Any], total_steps: int | None, group: dict[str, Any] | None = None,
                     where: Path | str = "the scheduler's state") -> Schedule:
    """A torch scheduler from its ``state_dict``: CosineAnnealingLR, LinearLR, StepLR, or OneCycleLR (its bounds in the
    param ``group``). Each argument is checked as torch checks it; a one-line refusal naming ``where`` otherwise."""
    base = state.get("base_lrs", [0.0])
    if not isinstance(base, (list, tuple)) or not base:
        raise refuse(where, f"base_lrs is {shown_value(base)}, not a list of learning rates")
    base_lr = number(base[0], where, "base_lrs[0]")
    if "_schedule_phases" in state and "_anneal_func_type" in state:
        return _one_cycle(state, group or {}, base_lr, where)
    if {"T_max", "eta_min"} <= state.keys():
        t_max = count(state["T_max"], where, "T_max", MAX_STEPS, low=1)
        eta_min = number(state["eta_min"], where, "eta_min")
        ratio = _rate(eta_min / base_lr if base_lr else 0.0, where, "eta_min over base_lrs[0]")
        return Schedule(f"CosineAnnealingLR (T_max {t_max}, eta_min {eta_min:g})", f"{_LR}.cosine_annealing",
                        {"t_max": t_max, "eta_min_ratio": ratio}, total_steps)
    if {"start_factor", "end_factor", "total_iters"} <= state.keys():
        kw = {"start_factor": fraction(state["start_factor"], where, "start_factor"),
              "end_factor": fraction(state["end_factor"], where, "end_factor"),
              "total_iters": count(state["total_iters"], where, "total_iters")}
        if kw["start_factor"] == 0:
            raise refuse(where, "start_factor is 0, not a number above 0 to 1")
        return Schedule(f"LinearLR ({kw['start_factor']:g} to {kw['end_factor']:g} over {kw['total_iters']} steps)",
                        f"{_LR}.linear_ramp", kw, total_steps)
    if {"step_size", "gamma"} <= state.keys():
        kw = {"step_size": count(state["step_size"], where, "step_size", MAX_STEPS, low=1),
              "gamma": number(state["gamma"], where, "gamma")}
        return Schedule(f"StepLR (every {kw['step_size']} steps x {kw['gamma']:g})", f"{_LR}.step_decay", kw,
                        total_steps)
    if "lr_lambdas" in state:
        return Schedule("LambdaLR", None, why_not="a LambdaLR's function is not in its checkpoint")
    keys = ", ".join(sorted(one_line(str(k))[:40] for k in state)[:8])
    return Schedule("a scheduler", None, why_not=f"its state ({keys}) is no scheduler with a counterpart here "
                                                  "(CosineAnnealingLR, LinearLR, StepLR, OneCycleLR)")


def _real(value: Any) -> float:
    """A scheduler state's number as a float (NaN and infinities kept, refused by the caller); ``TypeError`` else."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError("not a number")
    return float(value) if abs(value) <= sys.float_info.max or value != value else math.inf  # a huge int


def _rate(value: float, where: Path | str, name: str) -> float:
    if not math.isfinite(value):
        raise refuse(where, f"{name} is {value!r}, not a finite rate")
    return value


def _one_cycle(state: dict[str, Any], group: dict[str, Any], base_lr: float, where: Path | str) -> Schedule:
    """OneCycleLR: its phases' ends and the lr (as factors of ``initial_lr``) and beta1 at their bounds."""
    phases, anneal = state["_schedule_phases"], state["_anneal_func_type"]
    for flag in ("cycle_momentum", "use_beta1"):
        if not isinstance(state.get(flag, False), bool):
            raise refuse(where, f"{flag} is {shown_value(state.get(flag))}, not true or false")
    total = count(state.get("total_steps"), where, "total_steps", MAX_SCHEDULE_STEPS, low=1)
    if not isinstance(phases, list) or not 1 <= len(phases) <= 3 or not isinstance(anneal, str) or \
            anneal not in ("cos", "linear") or not base_lr:
        return Schedule("OneCycleLR", None, why_not="its OneCycleLR's state is not one torch writes")
    try:
        ends = [_real(p["end_step"]) for p in phases]
        lrs = [_real(group[phases[0]["start_lr"]])] + [_real(group[p["end_lr"]]) for p in phases]
        momenta = [_real(group[phases[0]["start_momentum"]])] + [_real(group[p["end_momentum"]]) for p in phases] \
            if state.get("cycle_momentum") else None
    except (KeyError, TypeError, IndexError):
        return Schedule("OneCycleLR", None, why_not="its OneCycleLR's phases name bounds its optimizer's param "
                                                    "group does not hold")
    if any(not math.isfinite(v) or v < 0 for v in ends + lrs) or any(not math.isfinite(v / base_lr) for v in lrs) \
            or any(not 0 <= v < 1 for v in momenta or []):
        return Schedule("OneCycleLR", None, why_not="its OneCycleLR's state is not one torch writes")
    if momenta is not None and not state.get("use_beta1"):
        return Schedule("OneCycleLR", None, why_not="its OneCycleLR cycles an SGD momentum, which AdamW has not")
    kwargs: dict[str, Any] = {"ends": ends, "factors": [v / base_lr for v in lrs], "anneal": anneal}
    if momenta is not None:
        kwargs["momenta"] = momenta
    cycled = f", beta1 {momenta[0]:g} to {min(momenta):g}" if momenta else ""
    return Schedule(f"OneCycleLR ({total} steps, lr {lrs[0]:g} to {max(lrs):g}{cycled})", f"{_LR}.one_cycle", kwargs,
                    total)


def factor(schedule: Schedule, step: int) -> float:
    """The factor of ``schedule`` at ``step`` (the lr is the base lr times it)."""
    return factor_function(schedule)(step)


def factor_function(schedule: Schedule) -> Callable[[int], float]:
    """``schedule``'s factor by step: the scheduler it names, built on a stand-in optimizer, asked for its lambda."""
    import torch

    from automodel_ckpt.training import lr as ours

    build = getattr(ours, schedule.target.rsplit(".", 1)[1])
    stand_in = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=1.0)
    return build(stand_in, schedule.total_steps, **schedule.kwargs).lr_lambdas[0]


def beta1(schedule: Schedule, step: int) -> float | None:
    """Adam's beta1 of ``schedule`` at ``step`` where it cycles it (OneCycleLR), else None."""
    from automodel_ckpt.training import lr as ours

    momenta = schedule.kwargs.get("momenta")
    if momenta is None:
        return None
    return ours._one_cycle_value(step, ends=schedule.kwargs["ends"], values=momenta, anneal=schedule.kwargs["anneal"])


def section_line(schedule: Schedule) -> str:
    """The ``lr_scheduler`` section that selects ``schedule``, as a YAML flow mapping."""
    pairs = [f"_target_: {schedule.target}"] + [f"{k}: {v!r}" for k, v in schedule.kwargs.items()]
    return "{" + ", ".join(pairs) + "}"


def check_recipe_schedule(schedule: Schedule, scheduler: Any, total_steps: int) -> None:
    """``ConfigError`` unless the recipe's scheduler (a ``LambdaLR``) has ``schedule``'s factor at every step."""
    if schedule.target is None:
        raise ConfigError(f"lr_scheduler: {schedule.why_not}")
    if schedule.total_steps is not None and schedule.total_steps != total_steps:
        raise ConfigError(f"lr_scheduler: the source's {schedule.described} ends at step {schedule.total_steps}, "
                          f"the recipe's at step {total_steps}: set --step_scheduler.max_steps {schedule.total_steps}")
    lambdas = getattr(scheduler, "lr_lambdas", None)
    cycling = getattr(scheduler, "beta1", None)
    wanted = factor_function(schedule)
    for step in range(total_steps + 1):
        want, got = wanted(step), lambdas[0](step) if lambdas else None
        differs = None
        if got is None or not math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12):
            differs = f"factor at step {step} is {'none' if got is None else f'{got:.6g}'}, the source's {want:.6g}"
        want_beta1, mine = beta1(schedule, step), cycling(step) if cycling is not None else None
        if differs is None and (want_beta1, mine) != (None, None) and \
                (mine is None or want_beta1 is None or not math.isclose(mine, want_beta1, rel_tol=1e-9)):
            differs = f"beta1 at step {step} is {_shown(mine)}, the source's {_shown(want_beta1)}"
        if differs:
            section = section_line(schedule)
            raise ConfigError(f"lr_scheduler: the source's schedule is {schedule.described}; the recipe's {differs}: "
                              f"write lr_scheduler: {section} in the recipe, or pass --lr_scheduler '{section}' to "
                              "import and to training")


def _shown(beta1_value: float | None) -> str:
    return "fixed" if beta1_value is None else f"{beta1_value:.6g}"
