"""DeepSpeed ZeRO checkpoints (stage 1, 2, 3; of `deepspeed.initialize` or the HF Trainer) read into a ``ForeignRun``.

SRC is a save folder (its ``latest`` names the tag), one ``global_stepN/`` folder, or an HF Trainer ``checkpoint-N/``
holding one. The ranks' partitions of the fp32 weights and AdamW's moments are put together here as
``deepspeed.utils.zero_to_fp32`` puts the weights together (its reader unpickles with ``weights_only=False``, so it is
never called on a source): stage 1 and 2 cut each flattened param group into equal parts, one a rank; stage 3 cuts
each parameter. Every pickle is read with ``weights_only=True``, DeepSpeed's own objects in it as inert records. The HF
Trainer's PEFT run (``adapter_config.json`` beside the tag folder) comes in as its adapter; other frozen parameters,
and tensor or pipeline parallel ranks, are refused. docs/import.md lists the files.
"""

from __future__ import annotations

import math
import os
import re
from functools import partial
from pathlib import Path
from typing import Any

import torch

from automodel_ckpt.interop import hf_trainer, names, schedules
from automodel_ckpt.interop.contract import ImportSource
from automodel_ckpt.interop.source import (MAX_BATCH, MAX_SCHEDULE_STEPS, SLACK, ForeignRun, Limits, Schedule, count,
                                           finite, load_inert, number, plain, read_bytes, read_json, refuse,
                                           rows_in_order)
from automodel_ckpt.ondisk import SMALL_FILE_LIMIT, HFFolder, path_inside, regular_file_problem
from automodel_ckpt.shown import shown_value

LATEST = "latest"
TAG = re.compile(r"global_step\d+")
OPTIM = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
MODEL_STATES = "mp_rank_00_model_states.pt"  # stage 1 and 2
ZERO3_MODEL_STATES = "zero_pp_rank_{}_mp_rank_00_model_states.pt"
LAYER = re.compile(r"layer_\d+-model_\d+-model_states\.pt")  # a pipeline engine's layers
MAX_RANKS = 1 << 16
MODULES = ("deepspeed.",)  # the only objects its pickles may name (as inert records)
_ALIEN = "which a DeepSpeed checkpoint does not hold"
_LR = "automodel_ckpt.training.lr"


def _tag_folder(src: Path) -> Path | None:
    """The ``global_stepN/`` folder of ``src`` (itself, its ``latest``'s, or its only one); None if it has none."""
    if TAG.fullmatch(src.name):
        return src
    if os.path.lexists(src / LATEST):
        tag = read_bytes(src / LATEST, "DeepSpeed's latest tag", 4096).decode("utf-8", "replace").strip()
        if not re.fullmatch(r"[A-Za-z0-9_.\-]+", tag) or tag in (".", ".."):
            raise refuse(src / LATEST, f"it names {shown_value(tag)}, not a tag folder")
        return path_inside(src, tag, f"'{src / LATEST}'")
    tags = sorted(p.name for p in src.iterdir() if TAG.fullmatch(p.name))
    if len(tags) > 1:
        raise refuse(src, f"it holds {len(tags)} tag folders ({tags[0]}, ...) and no {LATEST}: name one")
    return src / tags[0] if tags else None


def is_deepspeed(src: Path) -> bool:
    try:
        if not src.is_dir():
            return False
        if TAG.fullmatch(src.name):
            return any(OPTIM.fullmatch(n) for n in os.listdir(src))
        return any(TAG.fullmatch(n) for n in os.listdir(src))  # beside its latest, or alone
    except OSError:
        return False


def read(src: Path, limits: Limits) -> ForeignRun:
    """Everything of ``src`` that an import carries; one-line refusals."""
    folder = _tag_folder(src)
    if folder is None:
        raise refuse(src, "it holds no global_stepN/ tag folder")
    if folder.is_symlink() or not folder.is_dir():
        raise refuse(folder, "a symlink, or no folder: the tag folder is never followed as a link" if
                     folder.is_symlink() else "it is missing: a torn save folder (its latest names no tag folder)")
    trainer = src if os.path.lexists(src / hf_trainer.TRAINER_STATE) else None
    files = set(os.listdir(folder))
    layer = min((n for n in files if LAYER.fullmatch(n)), default=None)
    if layer:
        raise refuse(folder / layer, "a pipeline stage's layers: pipeline parallel runs are not imported")
    optim = _rank_files(folder, files)
    sizes = []
    for name in optim:
        why = regular_file_problem(folder / name)
        if why:
            raise refuse(folder / name, why)
        sizes.append(os.lstat(folder / name).st_size)
    if sum(sizes) > limits.optimizer + len(optim) * SLACK:
        raise refuse(folder, f"its optimizer partitions take {sum(sizes)} bytes, over the "
                             f"{limits.optimizer + len(optim) * SLACK} the recipe's model's AdamW state may take")
    states = [_load(folder / name, "a DeepSpeed optimizer partition", limits.optimizer) for name in optim]
    stage = _stage(states, folder / optim[0])
    model_name = MODEL_STATES if stage < 3 else ZERO3_MODEL_STATES.format(0)
    if model_name not in files:
        raise refuse(folder, f"it has no {model_name}: a torn tag folder")
    where = folder / model_name
    model = _load(where, "DeepSpeed's model states", limits.weights)
    if not isinstance(model, dict) or not isinstance(model.get("param_shapes"), list):
        raise refuse(where, "not DeepSpeed's model states (no param_shapes)")
    shapes = _shapes(model["param_shapes"], where)
    adapter_config = _adapter_config(trainer, model.get("frozen_param_shapes"), shapes, where)
    if adapter_config is not None:  # PEFT's names of the adapter, without its segment as it saves them
        shapes = [[(names.without_adapter(n), shape) for n, shape in group] for group in shapes]
    weights, moments, hypers = (_zero12 if stage < 3 else _zero3)(states, shapes, folder, optim)
    slot_names = [n for group in shapes for n, _ in group]
    opt = {"state": dict(enumerate(moments)),
           "param_groups": [dict(h, params=list(range(sum(len(g) for g in shapes[:i]),
                                                      sum(len(g) for g in shapes[:i + 1]))))
                            for i, h in enumerate(hypers)]}
    moments_out, groups = hf_trainer.optimizer_slots(opt, folder / optim[0])
    step = count(model.get("global_steps"), where, "global_steps")
    config = model.get("ds_config") if isinstance(model.get("ds_config"), dict) else {}
    batch = count(config.get("train_batch_size", 1), where, "train_batch_size", MAX_BATCH, low=1)
    world = count(model.get("dp_world_size", len(optim)), where, "dp_world_size", MAX_RANKS, low=1)
    notes = []
    state = hf_trainer.read_trainer(trainer, step) if trainer is not None else None
    if state is not None and not config.get("scheduler"):  # the Trainer's schedule, its base lr its learning_rate
        schedule = schedules.from_hf_trainer(state.args, state.max_steps)
        for g in groups:
            g["initial_lr"] = finite(state.args.get("learning_rate", g["lr"]), trainer, "learning_rate")
    else:
        schedule = _schedule(config.get("scheduler"), model.get("lr_scheduler"), step, groups, config, where, notes)
    if state is None:
        notes.append("DeepSpeed records no data position nor random generators' state: the run is taken to read "
                     f"the recipe's rows in order, {batch} a step, and the recipe's seed starts the generators")
    fields = state.fields(world) if state else {"position": partial(rows_in_order, step), "global_batch": batch,
                                                "rng": None}
    module = model.get("module") if stage < 3 and adapter_config is None else None
    module = {k: v for k, v in module.items() if isinstance(k, str) and isinstance(v, torch.Tensor) and k in weights} \
        if isinstance(module, dict) else None
    kind = f"DeepSpeed ZeRO-{stage} checkpoint (step {step}, {world} ranks)"
    return ForeignRun(kind=kind, weights=weights, adapter=adapter_config is not None, moments=moments_out,
                      groups=groups, order=names.slot_order(slot_names, where), schedule=schedule, step=step,
                      world_size=world, notes=notes, **fields,
                      module_weights=module if module and len(module) == len(weights) else None,
                      adapter_config=adapter_config)


# DeepSpeed's save folder (``latest``), a ``global_stepN/`` folder, or the HF Trainer's folder holding one
SOURCE = ImportSource("deepspeed", "a DeepSpeed checkpoint folder (global_stepN/, or one holding it)",
                      is_deepspeed, read)


def _load(path: Path, what: str, limit: int) -> Any:
    return load_inert(path, what, limit, MODULES, _ALIEN)


def _rank_files(folder: Path, files: set[str]) -> list[str]:
    """The optimizer partitions' files, by rank (0 to N-1, one each, one model-parallel rank); one-line refusals."""
    found: dict[int, str] = {}
    for name in files:
        match = OPTIM.fullmatch(name)
        if match is None:
            continue
        if int(match.group(3)) != 0:
            raise refuse(folder / name, "a model-parallel rank's partition: tensor or pipeline parallel runs are not "
                                        "imported")
        rank = int(match.group(2))
        if rank >= MAX_RANKS or rank in found:
            raise refuse(folder / name, f"rank {rank} is out of range or twice")
        found[rank] = name
    if not found:
        raise refuse(folder, "it holds no *_optim_states.pt: a torn tag folder, or one saved without the optimizer")
    missing = [r for r in range(max(found) + 1) if r not in found]
    if missing:
        raise refuse(folder, f"it has no rank {missing[0]}'s optimizer partition (zero_pp_rank_{missing[0]}_mp_rank_"
                             f"00_optim_states.pt) beside rank {max(found)}'s: a rank file is missing")
    return [found[r] for r in range(len(found))]


def _stage(states: list[Any], where: Path) -> int:
    stages, worlds = set(), set()
    for state in states:
        inner = state.get("optimizer_state_dict") if isinstance(state, dict) else None
        if not isinstance(inner, dict):
            raise refuse(where, "not a DeepSpeed optimizer partition (no optimizer_state_dict)")
        stage = plain(inner.get("zero_stage", 1))
        stages.add(count(stage, where, "zero_stage", 3, low=1))
        partitions = inner.get("partition_count", len(states))
        partitions = max(partitions) if isinstance(partitions, list) and partitions else partitions
        worlds.add(count(partitions, where, "partition_count", MAX_RANKS, low=1))
    if len(stages) != 1:
        raise refuse(where, f"its ranks' partitions are of ZeRO stages {sorted(stages)}: a torn tag folder")
    if worlds != {len(states)}:
        raise refuse(where, f"its partitions were cut for {max(worlds)} ranks and it holds {len(states)} rank files: "
                            "a rank file is missing")
    return stages.pop()


def _adapter_config(trainer: Path | None, frozen: Any, shapes: list[list[tuple[str, torch.Size]]],
                    where: Path) -> dict | None:
    """A PEFT run's adapter config: the HF Trainer's beside the tag folder (it saves the adapter alone, the recipe's
    model brings the base). Other frozen parameters (``frozen_param_shapes``) or LoRA weights are refused."""
    if trainer is not None and os.path.lexists(HFFolder(trainer).adapter_config):
        return read_json(HFFolder(trainer).adapter_config, "the adapter's config", SMALL_FILE_LIMIT)
    lora = next((n for group in shapes for n, _ in group if ".lora_" in n), None)
    if frozen or lora:
        raise refuse(where, f"it has {'frozen parameters' if frozen else repr(lora)[:200]} and no "
                            f"{HFFolder.adapter_config} beside it: the optimizer partitions hold no frozen parameter, "
                            "and only the HF Trainer's PEFT run (its adapter config beside the tag folder) is imported "
                            "as an adapter, on the recipe's model")
    return None


def _shapes(param_shapes: list[Any], where: Path) -> list[list[tuple[str, torch.Size]]]:
    out = []
    for group in param_shapes:
        if not isinstance(group, dict):
            raise refuse(where, "its param_shapes are not name-to-shape maps")
        pairs = []
        for name, shape in group.items():
            if not isinstance(name, str) or not isinstance(shape, (torch.Size, tuple, list)) or \
                    not all(isinstance(d, int) and 0 <= d < 2**40 for d in shape):
                raise refuse(where, f"its param_shapes hold {shown_value(name)}, not a named shape")
            pairs.append((name, torch.Size(shape)))
        out.append(pairs)
    return out


def _flat(values: Any, where: Path, what: str) -> list[torch.Tensor]:
    if not isinstance(values, (list, tuple)) or not all(isinstance(t, torch.Tensor) and t.dim() == 1 for t in values):
        raise refuse(where, f"its {what} is not a list of flat tensors")
    return [t.float() if t.dtype != torch.float32 else t for t in values]


def _base(state: dict[str, Any], key: str, where: Path, parts: int) -> tuple[list[dict], list[dict]]:
    """The base optimizer's per-partition AdamW state (``parts`` of them, by index) and its param groups."""
    base = state["optimizer_state_dict"].get(key)
    if not isinstance(base, dict) or not isinstance(base.get("state"), dict) or \
            not isinstance(base.get("param_groups"), list):
        raise refuse(where, "its base optimizer's state is missing: saved without the optimizer")
    slots = []
    for index in range(parts):
        slot = base["state"].get(index)
        if not isinstance(slot, dict) or not all(isinstance(slot.get(k), torch.Tensor)
                                                  for k in ("step", "exp_avg", "exp_avg_sq")):
            raise refuse(where, f"its partition {index} has no AdamW state (step, exp_avg, exp_avg_sq)")
        slots.append(slot)
    return slots, base["param_groups"]


def _hyper(group: Any, where: Path) -> dict[str, Any]:
    if not isinstance(group, dict):
        raise refuse(where, "a param group that is no mapping")
    return {k: v for k, v in group.items() if k != "params"}


def _zero12(states: list[Any], shapes: list[list[tuple[str, torch.Size]]], folder: Path,
            files: list[str]) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]], list[dict]]:
    """Stage 1 and 2: param group ``g``'s flat vector is rank 0's part, then rank 1's, ...; its parameters lie in it
    in order (with DeepSpeed's alignment paddings between them, where it records them)."""
    world = len(states)
    vectors: list[dict[str, list[torch.Tensor]]] = [{"w": [], "m": [], "v": []} for _ in shapes]
    steps, hypers = [], []
    for rank, (state, name) in enumerate(zip(states, files)):
        where = folder / name
        fp32 = _flat(state["optimizer_state_dict"].get("single_partition_of_fp32_groups"), where,
                     "single_partition_of_fp32_groups")
        if len(fp32) != len(shapes):
            raise refuse(where, f"it holds {len(fp32)} param groups, the model states {len(shapes)}")
        slots, groups = _base(state, "base_optimizer_state", where, len(shapes))
        for g, (part, slot) in enumerate(zip(fp32, slots)):
            _same_length(part, slot, where, g)
            if vectors[g]["w"] and part.numel() != vectors[g]["w"][0].numel():
                raise refuse(where, f"its partition of param group {g} holds {part.numel()} elements, rank 0's "
                                    f"{vectors[g]['w'][0].numel()}: partition sizes do not add up")
            vectors[g]["w"].append(part)
            vectors[g]["m"].append(slot["exp_avg"])
            vectors[g]["v"].append(slot["exp_avg_sq"])
        if rank == 0:
            steps = [slot["step"] for slot in slots]
            hypers = [_hyper(g, where) for g in groups]
    paddings = states[0]["optimizer_state_dict"].get("param_alignment_paddings")
    weights, moments = {}, []
    for g, group in enumerate(shapes):
        full = {k: torch.cat(v) for k, v in vectors[g].items()}
        pads = paddings[g] if isinstance(paddings, list) and g < len(paddings) else None
        if pads is not None and (not isinstance(pads, list) or len(pads) != len(group)):
            raise refuse(folder / files[0], f"its param_alignment_paddings of group {g} do not name its parameters")
        offset = 0
        for i, (name, shape) in enumerate(group):
            numel = shape.numel()
            if offset + numel > full["w"].numel():
                raise refuse(folder, f"param group {g} holds {full['w'].numel()} elements over {world} ranks, its "
                                     f"parameters need more ('{name}' ends at {offset + numel}): partition sizes do "
                                     "not add up (another model?)")
            weights[name] = full["w"][offset:offset + numel].view(shape).clone()
            moments.append({"step": steps[g].clone(), "exp_avg": full["m"][offset:offset + numel].view(shape).clone(),
                            "exp_avg_sq": full["v"][offset:offset + numel].view(shape).clone()})
            offset += numel + (count(pads[i], folder / files[0], "an alignment padding", 1 << 20) if pads else 0)
        align = 2 * world
        if math.ceil(offset / align) * align != math.ceil(full["w"].numel() / align) * align:
            raise refuse(folder, f"param group {g} holds {full['w'].numel()} elements over {world} ranks, its "
                                 f"parameters {offset}: partition sizes do not add up (another model?)")
    return weights, moments, hypers


def _zero3(states: list[Any], shapes: list[list[tuple[str, torch.Size]]], folder: Path,
           files: list[str]) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]], list[dict]]:
    """Stage 3: each parameter is cut into ``world`` equal parts (the last padded); rank ``r``'s flat vector holds
    its part of every parameter in order, and its AdamW moments lie the same way."""
    world = len(states)
    flats, hypers, steps = [], [], None
    for state, name in zip(states, files):
        where = folder / name
        fp32 = _flat(state["optimizer_state_dict"].get("fp32_flat_groups"), where, "fp32_flat_groups")
        slots, groups = _base(state, "optimizer_state_dict", where, len(fp32))
        for g, (part, slot) in enumerate(zip(fp32, slots)):
            _same_length(part, slot, where, g)
        flats.append({"w": torch.cat(fp32), "m": torch.cat([s["exp_avg"].float() for s in slots]),
                      "v": torch.cat([s["exp_avg_sq"].float() for s in slots])})
        if steps is None:
            steps, hypers = slots[0]["step"], [_hyper(g, where) for g in groups]
    lengths = {f["w"].numel() for f in flats}
    if len(lengths) != 1:
        raise refuse(folder, f"its ranks hold partitions of {sorted(lengths)} elements: partition sizes do not add up")
    length = lengths.pop()
    weights, moments, offset = {}, [], 0
    for name, shape in (pair for group in shapes for pair in group):
        numel = shape.numel()
        part = math.ceil(numel / world)
        if offset + part > length:
            raise refuse(folder, f"each rank holds {length} elements, the parameters need more ('{name}' ends past "
                                 "them): partition sizes do not add up (another model?)")
        pieces = {k: torch.cat([f[k][offset:offset + part] for f in flats])[:numel].view(shape).clone()
                  for k in ("w", "m", "v")}
        weights[name] = pieces["w"]
        moments.append({"step": steps.clone(), "exp_avg": pieces["m"], "exp_avg_sq": pieces["v"]})
        offset += part
    if offset != length:
        raise refuse(folder, f"each rank holds {length} elements, its parameters' parts {offset}: partition sizes do "
                             "not add up (another model?)")
    if len(hypers) != len(shapes):  # sub-groups cut from the param groups: mapped where the groups are alike
        if any(h != hypers[0] for h in hypers):
            raise refuse(folder, f"its {len(shapes)} ZeRO-3 sub-groups come from {len(hypers)} param groups with "
                                 "different hyperparameters, which the import does not map")
        hypers = [hypers[0]] * len(shapes)
    return weights, moments, hypers


def _same_length(part: torch.Tensor, slot: dict[str, torch.Tensor], where: Path, g: int) -> None:
    for key in ("exp_avg", "exp_avg_sq"):
        if slot[key].shape != part.shape:
            raise refuse(where, f"its {key} of partition {g} is {list(slot[key].shape)}, its fp32 weights "
                                f"{list(part.shape)}: partition sizes do not add up")


def _schedule(section: Any, state: Any, step: int, groups: list[dict], config: dict, where: Path,
              notes: list[str]) -> Schedule:
    """DeepSpeed's own scheduler (its config's ``scheduler``), or a client's torch scheduler from its state, or none.
    Each group's ``initial_lr`` is set to the lr its factors multiply."""
    if not section:
        if not state:
            return Schedule("no scheduler (constant lr)", f"{_LR}.constant_after_warmup", {"warmup_steps": 0})
        if not isinstance(state, dict):
            raise refuse(where, "its lr_scheduler state is no mapping")
        return schedules.from_torch_state(state, None, groups[0], where)
    if not isinstance(section, dict) or not isinstance(section.get("params", {}), dict):
        raise refuse(where, "its config's scheduler section is no mapping")
    kind, params = section.get("type"), section.get("params", {})
    if kind not in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"):
        return Schedule(f"DeepSpeed's {shown_value(kind)}", None, why_not=f"DeepSpeed's {shown_value(kind)} schedule "
                        "has no counterpart here (WarmupLR, WarmupDecayLR and WarmupCosineLR do)")
    position = state.get("last_batch_iteration") if isinstance(state, dict) else None
    if count(position, where, "the scheduler's last_batch_iteration", low=0) != step - 1 and step:
        raise refuse(where, f"its scheduler stepped {position + 1} times in {step} optimizer steps")
    warmup = max(2, count(params.get("warmup_num_steps", 1000), where, "warmup_num_steps", MAX_SCHEDULE_STEPS))
    log = params.get("warmup_type", "log") != "linear"
    if log and step <= warmup:
        return Schedule(f"DeepSpeed's {kind} (log warmup)", None, why_not=f"DeepSpeed's log warmup has no counterpart "
                        f"here and the run is in it (step {step} of {warmup}): continue it in DeepSpeed past its "
                        "warmup, or train with warmup_type linear")
    if log:
        notes.append(f"DeepSpeed's log warmup ended before step {step}: the schedule here has a linear one in its "
                     "place (the steps after it are DeepSpeed's)")
    total = None if kind == "WarmupLR" else \
        count(params.get("total_num_steps"), where, "total_num_steps", MAX_SCHEDULE_STEPS, low=warmup + 1)
    # DeepSpeed's lr at its iteration i is used at step i + 2 (iteration -1 at the first step): our factor at
    # step s is its value at iteration s - 1
    if kind == "WarmupCosineLR":
        if step < warmup:
            return Schedule(f"DeepSpeed's {kind}", None, why_not="the import continues DeepSpeed's WarmupCosineLR from "
                            f"the end of its warmup (step {warmup}), and the run is at step {step}")
        low = number(params.get("cos_min_ratio", 0.0001), where, "cos_min_ratio")
        org = config.get("optimizer", {}).get("params", {}).get("lr") if isinstance(config.get("optimizer"), dict) \
            else None
        ratio = _cosine_ratio(step - 1, warmup, total, low)
        base = number(org, where, "the optimizer's lr") if org is not None else groups[0]["lr"] / ratio
        for g in groups:
            g["initial_lr"] = base
        return Schedule(f"DeepSpeed's WarmupCosineLR ({warmup} warmup steps, to {low:g} at {total})",
                        f"{_LR}.cosine_decay", {"warmup_steps": warmup, "num_cycles": 0.5, "min_lr_rate": low}, total)
    top = number(params.get("warmup_max_lr", groups[0]["lr"]), where, "warmup_max_lr")
    low = number(params.get("warmup_min_lr", 0.0), where, "warmup_min_lr")
    if top <= 0 or low > top:
        raise refuse(where, f"its warmup_max_lr {top:g} is not above its warmup_min_lr {low:g}")
    for g in groups:
        g["initial_lr"] = top
    m = low / top
    ends, factors = ([1.0, warmup + 1.0, total + 1.0], [m, m, 1.0, m]) if total else \
        ([1.0, warmup + 1.0, warmup + 2.0], [m, m, 1.0, 1.0])
    tail = f", decaying to {low:g} at step {total}" if total else ""
    return Schedule(f"DeepSpeed's {kind} ({low:g} to {top:g} over {warmup} steps{tail})", f"{_LR}.one_cycle",
                    {"ends": ends, "factors": factors, "anneal": "linear"}, total)


def _cosine_ratio(i: int, warmup: int, total: int, low: float) -> float:
    progress = min(1.0, (i - warmup + 1) / max(1, total - warmup))
    return max(0.0, low + (1.0 - low) * (1 + math.cos(math.pi * progress)) / 2)

