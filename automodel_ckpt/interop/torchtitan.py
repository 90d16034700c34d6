"""torchtitan checkpoints (its ``CheckpointManager``'s ``step-N/`` DCP folders, Llama 3) read into a ``ForeignRun``.

SRC is one ``step-N/`` folder, the folder holding them (the newest complete one is read, as torchtitan's loader picks
it), or the job's dump folder holding ``checkpoint/`` and the job config (``--debug.save_config_file``): the only
record of the schedule. A step folder is read whole by ``ondisk.read_dcp_folder``; its data loader state is never
unpickled. The names, the fused QKV split and the RoPE permutation of q and k rows are torchtitan's own
(``Llama3StateDictAdapter.to_hf``, ``FusedQKVLinear``), written out here: importing its adapter needs triton. The head
counts come from the recipe's model (``ForeignRun.fit``). docs/import.md lists the entries.
"""

from __future__ import annotations

import os
import re
from functools import partial
from pathlib import Path
from typing import Any

import torch

from automodel_ckpt.interop import distcp, names
from automodel_ckpt.interop.contract import ImportSource
from automodel_ckpt.interop.hf_trainer import optimizer_slots
from automodel_ckpt.interop.source import (MAX_BATCH, MAX_SCHEDULE_STEPS, ForeignRun, Limits, Schedule, count,
                                           fraction, read_json, refuse, rows_in_order)
from automodel_ckpt.ondisk import SMALL_FILE_LIMIT, path_inside, read_dcp_folder
from automodel_ckpt.shown import shown_value

STEP = re.compile(r"step-(\d+)")
METADATA = ".metadata"
CHECKPOINT = "checkpoint"  # torchtitan's default checkpoint.folder, in its dump folder
MAX_CONFIGS = 16  # JSON files of SRC looked at for the job config
MAX_RANKS = 1 << 16
STATES = ("optimizer", "lr_scheduler", "dataloader", "train_state")
WHAT = "a torchtitan checkpoint of the recipe's model"
_LR = "automodel_ckpt.training.lr"
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "lm_head.weight": "lm_head.weight", "output.weight": "lm_head.weight"}  # output: torchtitan before 0.3
_IN_LAYER = {"attention.wo.weight": "self_attn.o_proj.weight", "feed_forward.w1.weight": "mlp.gate_proj.weight",
             "feed_forward.w2.weight": "mlp.down_proj.weight", "feed_forward.w3.weight": "mlp.up_proj.weight",
             "attention_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
             **{f"attention.{qkv}{w}.weight": f"self_attn.{p}_proj.weight"
                for qkv in ("qkv_linear.", "") for w, p in (("wq", "q"), ("wk", "k"), ("wv", "v"))}}
FUSED = "attention.qkv_linear.wqkv.weight"


def hf_name(name: str, where: Path) -> str:
    """The HF Llama's name of torchtitan's ``name`` (``Llama3StateDictAdapter``'s map); a one-line refusal for a name
    it does not map."""
    if name in _TOP:
        return _TOP[name]
    layer = _LAYER.fullmatch(name)
    if layer and layer.group(2) in _IN_LAYER:
        return f"model.layers.{layer.group(1)}.{_IN_LAYER[layer.group(2)]}"
    raise refuse(where, f"it holds '{name[:200]}', which torchtitan's Llama 3 state-dict adapter does not map "
                        "(another model?)")


def _steps(folder: Path) -> dict[int, Path]:
    try:
        return {int(m.group(1)): folder / n for n in os.listdir(folder) if (m := STEP.fullmatch(n))}
    except OSError:
        return {}


def is_torchtitan(src: Path) -> bool:
    try:
        return src.is_dir() and bool(STEP.fullmatch(src.name) or _steps(src) or
                                     (not (src / CHECKPOINT).is_symlink() and _steps(src / CHECKPOINT)))
    except OSError:
        return False


def _job_config(src: Path) -> tuple[dict[str, Any], Path] | tuple[None, None]:
    """torchtitan's job config among the JSON files of ``src`` (a mapping with an ``lr_scheduler`` section)."""
    found = []
    for name in sorted(n for n in os.listdir(src) if n.endswith(".json"))[:MAX_CONFIGS]:
        data = read_json(src / name, "a JSON file beside the checkpoint", SMALL_FILE_LIMIT)
        if isinstance(data.get("lr_scheduler"), dict):
            found.append((data, src / name))
    if len(found) > 1:
        raise refuse(src, f"it holds two torchtitan job configs ({found[0][1].name}, {found[1][1].name}): keep one")
    return found[0] if found else (None, None)


def _step_folder(src: Path, config: dict[str, Any] | None) -> Path:
    """The step folder SRC names: itself, or the newest complete one of it or of its checkpoint folder."""
    if STEP.fullmatch(src.name):
        return src
    steps = _steps(src)
    if not steps:
        section = (config or {}).get("checkpoint")
        folder = section.get("folder", CHECKPOINT) if isinstance(section, dict) else CHECKPOINT
        if not isinstance(folder, str):
            raise refuse(src, f"its job config's checkpoint.folder is {shown_value(folder)}, not a folder name")
        parent = path_inside(src, folder, f"'{src}'")
        steps = _steps(parent) if parent.is_dir() and not parent.is_symlink() else {}
    complete = {n: p for n, p in steps.items() if os.path.lexists(p / METADATA) and not p.is_symlink()}
    if not complete:
        linked = [p for p in steps.values() if p.is_symlink()]
        raise refuse(linked[0] if linked else src, "a symlink: step folders are never followed as links" if linked
                     else f"it holds no complete step-N/ folder (one with its {METADATA})")
    return complete[max(complete)]


def read(src: Path, limits: Limits) -> ForeignRun:
    """Everything of ``src`` that an import carries; one-line refusals."""
    config, config_path = _job_config(src)
    folder = _step_folder(src, config)
    if folder.is_symlink() or not os.path.lexists(folder / METADATA):
        raise refuse(folder, "a symlink: the step folder is never followed as a link" if folder.is_symlink() else
                     f"it has no {METADATA}: a torn save (torchtitan writes it last)")
    flat = read_dcp_folder(folder, limits.checkpoint, WHAT)
    where = folder / METADATA
    step = count(flat.get("train_state.step"), where, "train_state.step")
    if int(STEP.fullmatch(folder.name).group(1)) != step:
        raise refuse(where, f"its train_state.step {step} is not its folder's step: a torn or renamed folder")
    if count(flat.get("lr_scheduler.last_epoch"), where, "lr_scheduler.last_epoch") != step:
        raise refuse(where, f"its scheduler stepped {flat.get('lr_scheduler.last_epoch')} times in {step} steps")
    world = count(flat.get("dataloader.world_size", 1), where, "dataloader.world_size", MAX_RANKS, low=1)
    raw = {k: v for k, v in flat.items() if k.split(".", 1)[0] not in STATES}
    if not raw or not all(isinstance(v, torch.Tensor) for v in raw.values()):
        raise refuse(where, "its model entries are missing or not tensors")
    opt = distcp.optimizer({k: v for k, v in flat.items() if k.startswith("optimizer.state.")} |
                           _grouped(flat), "optimizer", where)
    moments, groups = optimizer_slots(opt, where)
    for name in raw:
        hf_name(name, where)
    slots, tensors = [], []  # a fused wqkv slot is three of ours, their moments split when the model is known
    for name, slot in zip([p for g in opt["param_groups"] for p in g["params"]], moments):
        parts = [name.replace("wqkv", w) for w in ("wq", "wk", "wv")] if name.endswith(FUSED) else [name]
        slots += [hf_name(p, where) for p in parts]
        tensors.append((name, slot))
    for group, g in zip(groups, opt["param_groups"]):
        group["count"] += 2 * sum(p.endswith(FUSED) for p in g["params"])
    run = ForeignRun(kind=f"torchtitan checkpoint (step {step}, {world} ranks)", weights={}, adapter=False, moments=[],
                     groups=groups, order=names.slot_order(slots, where),
                     schedule=_schedule(config, config_path, step), step=step,
                     position=partial(rows_in_order, step),
                     global_batch=_batch(config, config_path, world), world_size=world, rng=None,
                     notes=["torchtitan's data loader state is the position in its own dataset (not read) and it "
                            "records no random generators: the run is taken to read the recipe's rows in order, "
                            "and the recipe's seed starts the generators"])
    run.fit = lambda model: _fit(run, model, raw, tensors, where)
    return run


def _grouped(flat: dict[str, Any]) -> dict[str, Any]:
    """torchtitan's per-parameter group entries (``optimizer.param_groups.<name>.<key>``) as numbered groups of the
    parameters whose hyperparameters agree, in the order the parameters come."""
    keys = ("lr", "initial_lr", "betas", "eps", "weight_decay", "amsgrad")
    hypers: dict[str, dict[str, Any]] = {}
    prefix = "optimizer.param_groups."
    for key, value in flat.items():
        if key.startswith(prefix) and key.rsplit(".", 1)[1] in keys:
            name, field = key[len(prefix):].rsplit(".", 1)
            hypers.setdefault(name, {})[field] = tuple(value) if isinstance(value, list) else value
    groups: dict[tuple, list[str]] = {}
    for name, hyper in hypers.items():
        groups.setdefault(tuple(sorted((k, repr(v)) for k, v in hyper.items())), []).append(name)
    out = {}
    for index, members in enumerate(groups.values()):
        out |= {f"{prefix}{index}.{k}": v for k, v in hypers[members[0]].items()}
        out[f"{prefix}{index}.params"] = members
    return out


def _fit(run: ForeignRun, model: Any, raw: dict[str, torch.Tensor], tensors: list, where: Path) -> None:
    """The weights and moments in the HF Llama's layout for the recipe's ``model``'s head counts: a fused QKV slot
    split into q, k and v as ``FusedQKVLinear`` splits its weight, and q and k permuted as ``to_hf`` permutes them."""
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int) or heads < 1:
        raise refuse(where, "the recipe's model has no num_attention_heads: torchtitan's Llama 3 maps onto an HF Llama")
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or getattr(config, "hidden_size", 0) // heads
    if head_dim % 2 or head_dim < 2:
        raise refuse(where, f"the recipe's model's heads are of {head_dim}, not of pairs that RoPE rotates")

    def layout(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        if name.endswith(FUSED):
            if heads % kv or tensor.dim() != 2 or tensor.shape[0] != (heads + 2 * kv) * head_dim:
                raise refuse(where, f"its '{name}' is {list(tensor.shape)}, not the fused q, k and v of {heads} "
                                    f"heads and {kv} key-value heads of {head_dim}: another model")
            per = tensor.reshape(kv, heads // kv + 2, head_dim, tensor.shape[1])
            parts = {"wq": per[:, :heads // kv], "wk": per[:, heads // kv], "wv": per[:, heads // kv + 1]}
            return {hf: t for w, part in parts.items() for hf, t in layout(name.replace("wqkv", w),
                                                                            part.reshape(-1, tensor.shape[1])).items()}
        ours = hf_name(name, where)
        count_of = {"q_proj": heads, "k_proj": kv}.get(ours.rsplit(".", 2)[-2])
        if count_of is not None:
            if tensor.dim() != 2 or tensor.shape[0] != count_of * head_dim:
                raise refuse(where, f"its '{name}' is {list(tensor.shape)}, not {count_of} heads of {head_dim}: "
                                    "another model")
            rows, cols = tensor.shape
            tensor = tensor.reshape(count_of, rows // count_of // 2, 2, cols).transpose(1, 2).reshape(rows, cols)
        return {ours: tensor.contiguous()}

    run.weights = {k: v for name, t in raw.items() for k, v in layout(name, t).items()}
    run.moments = []
    for name, slot in tensors:
        if slot is None:
            run.moments += [None] * (3 if name.endswith(FUSED) else 1)
            continue
        if not all(k in slot for k in ("step", "exp_avg", "exp_avg_sq")):
            raise refuse(where, f"its optimizer's state for '{name}' is not AdamW's (step, exp_avg, exp_avg_sq)")
        split = {k: layout(name, slot[k]) for k in ("exp_avg", "exp_avg_sq")}
        run.moments += [{"step": slot["step"], **{k: split[k][ours] for k in split}} for ours in split["exp_avg"]]


def _schedule(config: dict[str, Any] | None, path: Path | None, step: int) -> Schedule:
    """torchtitan's ``LRSchedulersContainer`` (linear warmup, a stable part, then a linear, sqrt or cosine decay to
    ``min_lr_factor``) as ``training.lr.wsd``, whose factor is torchtitan's at every step."""
    if config is None:
        return Schedule("torchtitan's schedule (not recorded)", None, why_not=(
            f"a torchtitan checkpoint holds its schedule's position (step {step}), not its warmup, decay or steps: "
            "import the job's dump folder, which holds checkpoint/ and the job config that --debug.save_config_file "
            "NAME.json writes, or copy that file into SRC"))
    section = config["lr_scheduler"]
    training = config.get("training") if isinstance(config.get("training"), dict) else {}
    steps = count(training.get("steps", 10000), path, "training.steps", MAX_SCHEDULE_STEPS, low=1)
    total = section.get("total_steps")
    if total is not None and count(total, path, "lr_scheduler.total_steps", MAX_SCHEDULE_STEPS, low=1) != steps:
        return Schedule("torchtitan's schedule", None, why_not=f"its lr_scheduler.total_steps {total} is not its "
                        f"training.steps {steps}: a schedule that ends at another step than its run has no counterpart "
                        "here")
    kind = section.get("decay_type", "linear")
    if kind not in ("linear", "sqrt", "cosine"):
        raise refuse(path, f"lr_scheduler.decay_type is {shown_value(kind)}, not linear, sqrt or cosine")
    low = fraction(section.get("min_lr_factor", 0.0), path, "lr_scheduler.min_lr_factor")
    warmup = min(count(section.get("warmup_steps", 200), path, "lr_scheduler.warmup_steps", MAX_SCHEDULE_STEPS), steps)
    ratio = section.get("decay_ratio")
    decay = steps - warmup if ratio is None else \
        min(round(steps * fraction(ratio, path, "lr_scheduler.decay_ratio")), steps - warmup)
    return Schedule(f"torchtitan's warmup of {warmup} steps, then {kind} decay over the last {decay} of {steps} "
                    f"steps to {low:g}", f"{_LR}.wsd",
                    {"warmup_steps": warmup, "decay_steps": decay, "min_lr_ratio": low, "decay": kind}, steps)


def _batch(config: dict[str, Any] | None, path: Path | None, world: int) -> int | None:
    """Rows (sequences) a step: ``training.global_batch_size``, or (-1) ``local_batch_size`` on each rank."""
    training = config.get("training") if config else None
    if not isinstance(training, dict):
        return None
    if training.get("global_batch_size", -1) == -1:
        return count(training.get("local_batch_size", 8), path, "training.local_batch_size", MAX_BATCH, low=1) * world
    return count(training["global_batch_size"], path, "training.global_batch_size", MAX_BATCH, low=1)


SOURCE = ImportSource("torchtitan", "a torchtitan checkpoint (step-N/, or a folder holding step-N/ or "
                      "checkpoint/step-N/)", is_torchtitan, read)
