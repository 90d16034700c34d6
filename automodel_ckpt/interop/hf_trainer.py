"""The Hugging Face Trainer's ``checkpoint-N/`` folder, read into a ``ForeignRun`` (and its names for writing one).

Its files (docs/import.md lists them, the FSDP layout's DCP folders too) are each read as a regular file of the
folder, bounded by the recipe's model (``source.Limits``), and every value is checked before use.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from automodel_ckpt.interop import distcp, names, schedules, trainer_args
from automodel_ckpt.interop.contract import ImportSource
from automodel_ckpt.interop.source import (MAX_BATCH, MAX_SCHEDULE_STEPS, SMALL_PICKLE, ForeignRun, Limits, count,
                                           finite, fraction, load_pickle, load_record, number, plain, read_json,
                                           refuse)
from automodel_ckpt.ondisk import (INDEX_FILE_LIMIT, SMALL_FILE_LIMIT, HFFolder, MiB, check_path, check_size,
                                   path_inside, read_dcp_folder, regular_file_problem)
from automodel_ckpt.shown import shown_value

TRAINER_STATE = "trainer_state.json"
TRAINING_ARGS = "training_args.bin"
OPTIMIZER = "optimizer.pt"
SCHEDULER = "scheduler.pt"
RNG = "rng_state.pth"
MODEL = HFFolder.single_weights
MODEL_INDEX = HFFolder.index
ADAPTER = HFFolder.adapter_weights
FSDP_MODEL = "pytorch_model_fsdp_0"  # accelerate's FSDP_MODEL_NAME, model 0: {"model": state} by DCP
FSDP_OPTIMIZER = "optimizer_0"  # accelerate's OPTIMIZER_NAME, optimizer 0: {"optimizer": state} by DCP
MAX_LOG = 1_000_000
_FOR_WEIGHTS = "the weights of the recipe's model"
_FOR_OPTIMIZER = "the optimizer state of the recipe's model"


def is_hf_trainer(src: Path) -> bool:
    return src.is_dir() and os.path.lexists(src / TRAINER_STATE)  # a link there is refused when read


def read(src: Path, limits: Limits) -> ForeignRun:
    """Everything of ``src`` (a ``checkpoint-N/`` folder) that an import carries; one-line refusals."""
    files = set(os.listdir(src))  # whatever is not a regular file among those read is refused by name
    for name in (FSDP_MODEL, FSDP_OPTIMIZER):
        if (src / name).is_symlink():
            raise refuse(src / name, "a symlink; folders inside a checkpoint are never followed as links")
    folders = {p.name for p in src.iterdir() if p.is_dir() and not p.is_symlink()}
    sharded = FSDP_MODEL in folders and MODEL not in files and ADAPTER not in files
    if sharded and FSDP_OPTIMIZER not in folders:
        raise refuse(src, f"its model is in the Trainer's FSDP layout ({FSDP_MODEL}/) but it has no "
                          f"{FSDP_OPTIMIZER}/: a checkpoint saved with save_only_model carries no training state")
    for need in (SCHEDULER,) if sharded else (OPTIMIZER, SCHEDULER):
        if need not in files:
            raise refuse(src, f"it has no {need}: a checkpoint saved with save_only_model carries no training state")
    trainer = read_trainer(src)
    step, world = trainer.step, max(1, sum(f.startswith("rng_state_") and f.endswith(".pth") for f in files))
    adapter = ADAPTER in files
    adapter_config = None
    if adapter:
        if HFFolder.adapter_config not in files:
            raise refuse(src, f"its adapter has no {HFFolder.adapter_config}")
        adapter_config = read_json(HFFolder(src).adapter_config, "the adapter's config", SMALL_FILE_LIMIT)
    if sharded:  # FSDP's state dicts name every parameter: slots are matched by name
        weights = distcp.weights(read_dcp_folder(src / FSDP_MODEL, limits.weights, _FOR_WEIGHTS), "model",
                                 src / FSDP_MODEL)
        opt = distcp.optimizer(read_dcp_folder(src / FSDP_OPTIMIZER, limits.optimizer, _FOR_OPTIMIZER), "optimizer",
                               src / FSDP_OPTIMIZER)
        moments, groups = optimizer_slots(opt, src / FSDP_OPTIMIZER)
        order = names.slot_order([p for g in opt["param_groups"] for p in g["params"]], src / FSDP_OPTIMIZER)
    else:
        weights = _weights(src, files, adapter, limits)
        weight_bytes = sum(t.numel() * 4 for t in weights.values())  # the optimizer's bound: from the weights read
        opt = load_pickle(src / OPTIMIZER, "the optimizer's state", 8 * weight_bytes + 16 * MiB)
        moments, groups = optimizer_slots(opt, src / OPTIMIZER)
        order = names.hf_trainer_order
    sched = load_pickle(src / SCHEDULER, "the scheduler's state", SMALL_PICKLE)
    if not isinstance(sched, dict) or count(sched.get("last_epoch"), src / SCHEDULER, "last_epoch") != step:
        raise refuse(src / SCHEDULER, f"its position is not the checkpoint's step {step}")
    return ForeignRun(kind=f"HF Trainer checkpoint (step {step})", weights=weights, adapter=adapter, moments=moments,
                      groups=groups, order=order, schedule=schedules.from_hf_trainer(trainer.args, trainer.max_steps),
                      step=step, world_size=world, adapter_config=adapter_config, **trainer.fields(world))


@dataclass(frozen=True)
class TrainerState:
    """What the Trainer's own files of a ``checkpoint-N/`` say: ``trainer_state.json``, ``training_args.bin``
    (``trainer_args.checked``) and rank 0's random generators."""

    step: int
    max_steps: int
    per_device: int  # rows a device takes a micro-batch
    epoch: float
    args: dict[str, Any]
    rng: dict[str, Any] | None
    log: list[dict[str, Any]]

    def fields(self, world: int) -> dict[str, Any]:
        """The ``ForeignRun`` fields it gives, for a run on ``world`` data-parallel ranks."""
        accum = self.args.get("gradient_accumulation_steps", 1)
        per_step, drop_last = self.per_device * world, self.args.get("dataloader_drop_last", False)
        return {"position": lambda rows, _: trainer_position(self.step, rows, per_step, accum, drop_last),
                "global_batch": per_step * accum, "rng": self.rng, "log": self.log, "epoch_float": self.epoch}


def read_trainer(src: Path, step: int | None = None) -> TrainerState:
    """The Trainer's files of ``src``, each value checked; ``step``: the one the optimizer's files say (DeepSpeed's),
    which ``global_step`` must be."""
    files, where = set(os.listdir(src)), src / TRAINER_STATE
    state = read_json(where, "the Trainer's state")
    global_step = count(state.get("global_step"), where, "global_step")
    if step is not None and global_step != step:
        raise refuse(where, f"its global_step {global_step} is not its optimizer's step {step}")
    max_steps = count(state.get("max_steps"), where, "max_steps", MAX_SCHEDULE_STEPS, low=1)
    per_device = count(state.get("train_batch_size"), where, "train_batch_size", MAX_BATCH, low=1)
    epoch = number(state.get("epoch") or 0, where, "epoch")
    if epoch > global_step + 1:
        raise refuse(where, f"epoch {epoch:g} is past its global_step {global_step}")
    if global_step > max_steps:
        raise refuse(where, f"global_step {global_step} is past its max_steps {max_steps}")
    if TRAINING_ARGS not in files:
        raise refuse(src, f"it has no {TRAINING_ARGS}: the schedule's kind and warmup are recorded only there")
    args = {k: plain(v) for k, v in load_record(src / TRAINING_ARGS, "the Trainer's arguments").fields().items()}
    args = trainer_args.checked(args, src / TRAINING_ARGS)  # every field it reads: of its type, in its range
    rng_file = next((src / n for n in (RNG, "rng_state_0.pth") if n in files), None)
    rng = None if rng_file is None else \
        rng_state(load_pickle(rng_file, "the random generators' state", SMALL_PICKLE, numpy=True), rng_file)
    log = logged_steps(state.get("log_history"), where)
    return TrainerState(global_step, max_steps, per_device, epoch, args, rng, log)


SOURCE = ImportSource("hf-trainer", f"an HF Trainer checkpoint-N/ folder ({TRAINER_STATE})", is_hf_trainer, read)


def trainer_position(step: int, rows: int, per_step: int, accum: int, drop_last: bool) -> tuple[int, int, int]:
    """(epoch, steps taken in it, steps per epoch) as the Trainer counts them for ``rows`` training rows."""
    batches = rows // per_step if drop_last else math.ceil(rows / per_step)
    per_epoch = max(batches // accum, 1)
    return step // per_epoch, step % per_epoch, per_epoch


def _weights(src: Path, files: set[str], adapter: bool, limits: Limits) -> dict[str, torch.Tensor]:
    """The weight files' tensors, each a regular file of ``src``, their sizes together within ``limits.weights``."""
    from safetensors.torch import load_file

    if adapter:
        chosen = [ADAPTER]
    elif MODEL in files:
        chosen = [MODEL]
    elif MODEL_INDEX in files:
        index = read_json(src / MODEL_INDEX, "the model's index", INDEX_FILE_LIMIT)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict):
            raise refuse(src / MODEL_INDEX, "it has no weight_map")
        chosen = sorted({check_path(v, f"'{src / MODEL_INDEX}'") for v in weight_map.values()})
    else:
        raise refuse(src, f"it holds no {MODEL}, {MODEL_INDEX} or {ADAPTER}")
    chosen_paths, total = [], 0
    for name in chosen:
        path = path_inside(src, name, f"'{src}'")
        try:
            why = regular_file_problem(path)
        except FileNotFoundError:
            raise refuse(path, "it is missing") from None
        if why is not None:
            raise refuse(path, why)
        total += path.stat().st_size
        chosen_paths.append(path)
    check_size(total, f"'{src}' (its weight files)", _FOR_WEIGHTS, limits.weights)
    weights: dict[str, torch.Tensor] = {}
    for path in chosen_paths:
        try:
            weights.update(load_file(str(path)))
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own errors for a bad header
            raise refuse(path, f"unreadable safetensors ({str(exc).splitlines()[0][:200]})") from None
    return weights


def optimizer_slots(opt: Any, where: Path) -> tuple[list[dict[str, torch.Tensor] | None], list[dict[str, Any]]]:
    """A torch optimizer ``state_dict``'s AdamW state per slot (its groups' order) and its groups' hyperparameters."""
    if not isinstance(opt, dict) or not isinstance(opt.get("state"), dict) or \
            not isinstance(opt.get("param_groups"), list):
        raise refuse(where, "not an optimizer's state (state and param_groups)")
    groups, moments = [], []
    for g in opt["param_groups"]:
        if not isinstance(g, dict) or not isinstance(g.get("params"), list):
            raise refuse(where, "a param group without its list of params")
        betas = g.get("betas")
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise refuse(where, "a param group without AdamW's betas: only AdamW's state is imported")
        amsgrad = g.get("amsgrad", False)
        if not isinstance(amsgrad, bool):
            raise refuse(where, f"a param group's amsgrad is {shown_value(amsgrad)}, not true or false")
        hyper = {"lr": number(g.get("lr"), where, "lr"), "betas": (fraction(betas[0], where, "beta1", below_one=True),
                                                                    fraction(betas[1], where, "beta2", below_one=True)),
                 "eps": number(g.get("eps"), where, "eps"),
                 "weight_decay": number(g.get("weight_decay", 0.0), where, "weight_decay"),
                 "initial_lr": number(g.get("initial_lr", g.get("lr")), where, "initial_lr"),
                 "amsgrad": amsgrad, "count": len(g["params"])}
        if hyper["amsgrad"]:
            raise refuse(where, "AdamW with amsgrad: its max_exp_avg_sq has no counterpart here")
        groups.append(hyper)
        for idx in g["params"]:
            if not isinstance(idx, (int, str)):
                raise refuse(where, "a param group names a parameter by neither index nor name")
            slot = opt["state"].get(idx)
            if slot is not None and not (isinstance(slot, dict) and all(isinstance(v, torch.Tensor) for v in
                                                                         slot.values())):
                raise refuse(where, f"the state of parameter {str(idx)[:20]} is not tensors")
            moments.append(slot)
    return moments, groups


def rng_state(state: Any, where: Path) -> dict[str, Any] | None:
    """Python's, NumPy's and torch's CPU generators, in our ``RNGState``'s shape."""
    import numpy as np

    try:
        py, npy, cpu = state["python"], state["numpy"], state["cpu"]
        version, internal, gauss = py
        if len(internal) != 625 or not all(isinstance(v, int) for v in internal):
            raise ValueError("python")
        name, keys, pos, has_gauss, cached = npy
        if not (isinstance(keys, np.ndarray) and keys.shape == (624,) and keys.dtype == np.uint32):
            raise ValueError("numpy")
        if not (isinstance(cpu, torch.Tensor) and cpu.dtype == torch.uint8 and cpu.dim() == 1):
            raise ValueError("torch")
    except (KeyError, TypeError, ValueError) as exc:
        raise refuse(where, f"not the Trainer's random generators' state ({exc})") from None
    return {"python": (int(version), tuple(internal), gauss),
            "numpy": {"name": str(name), "keys": torch.from_numpy(keys.copy()), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
            "torch": cpu.clone()}


def logged_steps(history: Any, where: Path) -> list[dict[str, Any]]:
    """The logged training steps (step, loss, lr, grad_norm) of the Trainer's log history, each a finite number (lr
    and grad_norm may be absent)."""
    if not isinstance(history, list):
        return []
    if len(history) > MAX_LOG:
        raise refuse(where, f"its log history holds {len(history)} entries, over {MAX_LOG}")
    out = []
    for i, entry in enumerate(history):
        if isinstance(entry, dict) and "loss" in entry and "step" in entry:  # a training step's (not an evaluation's)
            field = f"log_history[{i}]."
            out.append({"step": count(entry["step"], where, field + "step"),
                        "loss": finite(entry["loss"], where, field + "loss"),
                        **{ours: None if entry.get(key) is None else finite(entry[key], where, field + key)
                           for ours, key in (("lr", "learning_rate"), ("grad_norm", "grad_norm"))}})
    return out
