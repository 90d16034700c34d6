"""A recipe's restored state written as an HF Trainer ``checkpoint-N/`` that the Trainer resumes.

The Trainer rebuilds its schedule from its own arguments (only the position is read from ``scheduler.pt``), so the
export says which arguments continue ours (``trainer_arguments``), or refuses a schedule the Trainer has not.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from automodel_ckpt.errors import ConfigError
from automodel_ckpt.interop import hf_trainer, names

_LR = "automodel_ckpt.training.lr."


def trainer_arguments(lr_section: dict[str, Any], total_steps: int) -> dict[str, Any]:
    """The HF Trainer arguments whose schedule is the recipe's ``lr_scheduler`` section; ``ConfigError`` if none."""
    target = str(lr_section.get("_target_", ""))
    kind = target.removeprefix(_LR)
    warmup = int(lr_section.get("warmup_steps", 0) or 0)
    out: dict[str, Any] = {"max_steps": total_steps, "warmup_steps": warmup}
    if kind == "linear_decay":
        return out | {"lr_scheduler_type": "linear"}
    if kind == "constant_after_warmup" or kind == "constant":
        return out | {"lr_scheduler_type": "constant_with_warmup" if warmup else "constant"}
    if kind == "cosine_decay":
        rate = float(lr_section.get("min_lr_rate", 0.0) or 0.0)
        cycles = float(lr_section.get("num_cycles", 0.5))
        if rate:
            return out | {"lr_scheduler_type": "cosine_with_min_lr",
                          "lr_scheduler_kwargs": {"min_lr_rate": rate, "num_cycles": cycles}}
        return out | {"lr_scheduler_type": "cosine"} | ({"lr_scheduler_kwargs": {"num_cycles": cycles}}
                                                         if cycles != 0.5 else {})
    raise ConfigError(f"lr_scheduler: {target} has no HF Trainer counterpart (linear_decay, cosine_decay, "
                      f"constant_after_warmup and constant have)")


def write(recipe: Any, out: Path, log: list[dict[str, Any]]) -> dict[str, Any]:
    """Write ``recipe``'s state (restored, 1 process) into the folder ``out``; returns the Trainer's arguments."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    import numpy as np

    model, optimizer, sched = recipe.model, recipe.optimizer, recipe.step_scheduler
    if not isinstance(optimizer, torch.optim.AdamW):
        raise ConfigError(f"optimizer._target_: the HF Trainer resumes AdamW's state; this run's is "
                          f"{type(optimizer).__name__}'s")
    from omegaconf import OmegaConf

    args = trainer_arguments(OmegaConf.to_container(recipe.cfg.lr_scheduler, resolve=True), sched.total_steps)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.get_rng_state()}
    out.mkdir(parents=True, exist_ok=True)
    peft = hasattr(model, "peft_config")
    full = get_model_state_dict(model, options=options)
    if peft:
        trained = set(names.trainable(model))
        adapter = {k.replace(f".{names.ADAPTER}.", "."): v.contiguous() for k, v in full.items() if k in trained}
        save_file(adapter, str(out / hf_trainer.ADAPTER), metadata={"format": "pt"})
        model.peft_config[names.ADAPTER].save_pretrained(str(out))
    else:
        model.save_pretrained(str(out), state_dict=full, safe_serialization=True)
    osd = get_optimizer_state_dict(model, optimizer, options=options)
    decay, no_decay = names.hf_trainer_groups(model)
    order, decayed = decay + no_decay, len(decay)
    ours = {name: {k: v for k, v in g.items() if k != "params"} for g in osd["param_groups"] for name in g["params"]}
    state = {i: osd["state"][name] for i, name in enumerate(order) if name in osd["state"]}
    # the Trainer's two groups, each with the hyperparameters of our group that holds its parameters (one group of
    # ours: both with its weight decay, which the Trainer's load_state_dict keeps)
    groups = []
    for members, first in ((decay, 0), (no_decay, decayed)):
        hyper = ours[members[0]] if members else ours[order[0]]
        odd = [n for n in members if ours[n] != hyper]
        if odd:
            raise ConfigError(f"optimizer: '{members[0]}' and '{odd[0]}' are in one of the HF Trainer's groups "
                              "(with and without weight decay) but in two of ours with other hyperparameters")
        groups.append(hyper | {"params": list(range(first, first + len(members)))})
    group = groups[0]
    torch.save({"state": state, "param_groups": groups}, out / hf_trainer.OPTIMIZER)
    lr_state = recipe.lr_scheduler.state_dict()
    torch.save({"base_lrs": [g.get("initial_lr", g["lr"]) for g in groups], "last_epoch": lr_state["last_epoch"],
                "_step_count": lr_state["_step_count"], "_is_initial": False, "_get_lr_called_within_step": False,
                "_last_lr": [g["lr"] for g in groups], "lr_lambdas": [{}, {}]}, out / hf_trainer.SCHEDULER)
    torch.save(rng, out / hf_trainer.RNG)
    loader = recipe.dataloader
    per_epoch = max(loader.steps_per_epoch, 1)
    epoch = sched.epoch + (loader.position // loader.global_batch_size) / per_epoch
    from transformers import TrainerControl, TrainerState

    history = [{"step": r["step"], "loss": r["loss"], "learning_rate": r.get("lr"), "grad_norm": r.get("grad_norm")}
               for r in log if r.get("step", 0) <= sched.step]
    TrainerState(epoch=epoch, global_step=sched.step, max_steps=sched.total_steps, logging_steps=1, eval_steps=500,
                 save_steps=sched.step, train_batch_size=loader.global_batch_size,
                 num_train_epochs=recipe.cfg.step_scheduler.num_epochs, log_history=history,
                 stateful_callbacks=[TrainerControl()]).save_to_json(str(out / hf_trainer.TRAINER_STATE))
    return args | {"learning_rate": group.get("initial_lr", group["lr"]), "weight_decay": group["weight_decay"],
                   "adam_beta1": group["betas"][0], "adam_beta2": group["betas"][1], "adam_epsilon": group["eps"],
                   "max_grad_norm": float(recipe.cfg.training.max_grad_norm),
                   "per_device_train_batch_size": loader.global_batch_size,
                   "train_sampling_strategy": "sequential" if not loader.shuffle else "random"}
