"""Lightning's ``.ckpt`` file, and its distributed checkpoint folder, read into a ``ForeignRun``.

The folder (``FSDPStrategy(state_dict_type="sharded")``, ``ModelParallelStrategy``) holds the weights and optimizer
state as DCP entries and the rest of the ``.ckpt`` in ``meta.pt``. Lightning records neither its batch size nor its
generators (the recipe's are taken); the optimizer's slots follow the module's ``parameters()`` order.
"""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path
from typing import Any

import torch

from automodel_ckpt.interop import distcp, names, schedules
from automodel_ckpt.interop.contract import ImportSource
from automodel_ckpt.interop.hf_trainer import optimizer_slots
from automodel_ckpt.interop.source import (MAX_STEPS, ForeignRun, Limits, Schedule, count, load_pickle, refuse,
                                           rows_in_order)
from automodel_ckpt.ondisk import read_dcp_folder

SUFFIX = ".ckpt"
DCP_METADATA = ".metadata"
META = "meta.pt"  # a distributed checkpoint's counters, loops and schedulers (lightning.fabric.utilities.load)
MAX_META = 64 * 2**20
MODEL_KEYS = ("model", "state_dict")  # FSDPStrategy's, ModelParallelStrategy's
WHAT = "a Lightning checkpoint of the recipe's model"  # its bound: ``Limits.checkpoint``


def is_lightning_file(src: Path) -> bool:
    return src.is_file() and src.suffix == SUFFIX


def is_lightning_folder(src: Path) -> bool:
    return src.is_dir() and os.path.lexists(src / DCP_METADATA)  # a link there is refused when read


def read_folder(src: Path, limits: Limits) -> ForeignRun:
    """A Lightning distributed checkpoint folder, as the ``.ckpt`` it would consolidate to: its files regular files of
    the folder, reached without following a link, its data files within ``limits.checkpoint``; one-line refusals."""
    if not os.path.lexists(src / META):
        raise refuse(src, f"it has no {META}: not a Lightning distributed checkpoint")
    ckpt = load_pickle(src / META, "Lightning's checkpoint metadata", MAX_META)
    if not isinstance(ckpt, dict):
        raise refuse(src / META, "not Lightning's checkpoint metadata")
    flat = read_dcp_folder(src, limits.checkpoint, WHAT)
    tops = {k.split(".", 1)[0] for k in flat}  # the entries: the model's, the optimizers'
    model = [k for k in MODEL_KEYS if k in tops]
    if len(model) != 1:
        raise refuse(src, "it holds " + ("no" if not model else "two") + " model entries ('model' of FSDPStrategy, "
                          "'state_dict' of ModelParallelStrategy)")
    optimizers = sorted(k for k in tops if k.startswith("optimizer_"))
    stray = sorted(tops - set(model) - set(optimizers))
    if stray:
        raise refuse(src, f"it holds '{stray[0]}', which a Lightning checkpoint does not")
    ckpt = dict(ckpt, state_dict=distcp.weights(flat, model[0], src),
                optimizer_states=[distcp.optimizer(flat, k, src) for k in optimizers])
    return _read(ckpt, src, "Lightning distributed checkpoint")


def read_file(src: Path, limits: Limits) -> ForeignRun:
    """A Lightning ``.ckpt`` (the file the user named: a link to it is followed) of at most ``limits.checkpoint``
    bytes; one-line refusals."""
    return _read(load_pickle(src, WHAT, limits.checkpoint, follow=True), src, "Lightning checkpoint")


FILE_SOURCE = ImportSource("lightning", f"a Lightning {SUFFIX} file", is_lightning_file, read_file)
# Lightning's distributed checkpoint folder: DCP entries (``.metadata``) and ``meta.pt``
FOLDER_SOURCE = ImportSource("lightning-dcp", f"a Lightning distributed checkpoint folder ({DCP_METADATA})",
                             is_lightning_folder, read_folder)


def _read(ckpt: Any, src: Path, kind: str) -> ForeignRun:
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("state_dict"), dict):
        raise refuse(src, "not a Lightning checkpoint (no state_dict)")
    step = count(ckpt.get("global_step"), src, "global_step")
    weights = ckpt["state_dict"]
    if not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in weights.items()):
        raise refuse(src, "its state_dict holds entries that are not named tensors")
    opts = ckpt.get("optimizer_states")
    if not isinstance(opts, list) or len(opts) != 1:
        raise refuse(src, f"it holds {len(opts) if isinstance(opts, list) else 'no'} optimizer states; one AdamW's "
                          "is imported")
    moments, groups = optimizer_slots(opts[0], src)
    slots = [p for g in opts[0]["param_groups"] for p in g["params"]]
    named = all(isinstance(p, str) for p in slots)  # an FSDP optimizer state (consolidated): slots by name
    order = names.slot_order(slots, src) if named else names.trainable  # parameters() order
    scheds = ckpt.get("lr_schedulers") or []
    if not isinstance(scheds, list) or len(scheds) > 1 or (scheds and not isinstance(scheds[0], dict)):
        raise refuse(src, "it holds more than one learning-rate scheduler")
    if scheds:
        state = scheds[0]
        if count(state.get("last_epoch"), src, "the scheduler's last_epoch") != step:
            raise refuse(src, f"its scheduler stepped {state.get('last_epoch')} times in {step} optimizer steps: a "
                              "schedule per epoch has no counterpart here (interval 'step' has)")
        schedule = schedules.from_torch_state(state, None, opts[0]["param_groups"][0], src)
    else:
        schedule = Schedule("no scheduler (constant lr)", "automodel_ckpt.training.lr.constant_after_warmup",
                            {"warmup_steps": 0})
    loops = ckpt.get("loops") if isinstance(ckpt.get("loops"), dict) else {}
    fit = loops.get("fit_loop") if isinstance(loops.get("fit_loop"), dict) else {}
    batches = _completed(fit.get("epoch_loop.batch_progress"), "total")
    accum = max(1, round(batches / step)) if step and batches else 1
    return ForeignRun(kind=f"{kind} (step {step})", weights=dict(weights), adapter=False,
                      moments=moments, groups=groups, order=order, schedule=schedule, step=step,
                      position=partial(rows_in_order, step), global_batch=None, world_size=1,
                      rng=None, notes=["Lightning records no random generators' state: the recipe's seed "
                                       "starts them" + (f"; it accumulated {accum} batches a step" if accum > 1
                                                        else "")])


def _completed(progress: Any, which: str) -> int:
    """A loop's count of completed batches (0 where it holds none, or no count)."""
    try:
        value = progress[which]["completed"]
    except (KeyError, TypeError, IndexError):
        return 0
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_STEPS else 0
