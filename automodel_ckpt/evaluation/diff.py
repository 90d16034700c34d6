"""What differs between two models' tensors, one tensor at a time, and between two checkpoints' recipes and counters.

Each side is read as ``open_tensors`` reads it, or, an export target's file, as its target pairs it with the other
side (``ExportTarget.beside``); a tensor is compared and dropped, so memory is bounded by the largest one. A checkpoint
against its own bf16 export is ``close`` (equal once rounded to the coarser dtype); against a quantized side, within
both sides' rounding (``ModelSource.rounding`` and half an ulp of the read dtype). docs/inspect-and-diff.md.
"""

from __future__ import annotations

import math
import os
import re
from collections import Counter
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from automodel_ckpt.errors import CheckpointError, UserError, first_line
from automodel_ckpt.evaluation.tensors import open_tensors
from automodel_ckpt.export import ModelSource, identify
from automodel_ckpt.ondisk import (CONFIG_FILE_LIMIT, SMALL_FILE_LIMIT, CheckpointFolder, read_json, read_yaml,
                                   regular_file_problem)

__all__ = ["EQUAL", "CLOSE", "CHANGED", "ONLY_A", "ONLY_B", "DiffReport", "diff"]

EQUAL, CLOSE, CHANGED, ONLY_A, ONLY_B = "equal", "close", "changed", "only_a", "only_b"
_BLOCK = re.compile(r"(?:^|\.)(?:layers|h|blocks|block|blk)\.(\d+)\.")
_TOWER = ("vision_tower", "vision_model", "visual.")
_PROJECTOR = ("multi_modal_projector", "mm_projector", "image_newline")
_EMBED = ("embed_tokens", "wte", "wpe", "tok_embeddings", "word_embeddings", "embed_in")
_HEAD = ("lm_head", "embed_out", "output.weight")
_COUNTERS = ("step", "epoch", "consumed_samples", "consumed_tokens", "dpo_step", "consumed_pairs", "grpo_step",
             "ppo_optimization_step")


@dataclass
class TensorDiff:
    status: str
    max_abs: float | None = None
    rel_l2: float | None = None
    changed_fraction: float | None = None
    note: str = ""  # a shape or dtype change

    def as_json(self) -> dict[str, Any]:  # a changed fraction and a note only where there is one
        return {k: v for k, v in asdict(self).items() if k in ("max_abs", "rel_l2") or v not in (None, "")}


@dataclass
class DiffReport:
    a: str
    b: str
    tensors: dict[str, TensorDiff] = field(default_factory=dict)
    recipe: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # dotted key -> (a's value, b's value)
    counters: dict[str, tuple[Any, Any]] = field(default_factory=dict)

    @property
    def equal(self) -> bool:
        """No tensor changed or on one side only (``close`` counts as equal: within the tolerance or rounding)."""
        return all(d.status in (EQUAL, CLOSE) for d in self.tensors.values())

    def groups(self) -> dict[str, dict[str, int]]:
        """Per module group (embeddings, each block, the head, adapters, a tower, its projector, other): tensors by
        status."""
        out: dict[str, Counter[str]] = {}
        for name, d in self.tensors.items():
            out.setdefault(group(name), Counter())[d.status] += 1
        return out

    def as_json(self) -> dict[str, Any]:
        totals = Counter(d.status for d in self.tensors.values())
        summary: dict[str, Any] = {"equal": self.equal, "tensors": totals, "groups": self.groups()}
        if self.recipe or self.counters:
            summary["recipe"] = {k: list(v) for k, v in self.recipe.items()}
            summary["counters"] = {k: list(v) for k, v in self.counters.items()}
        return {"a": self.a, "b": self.b, "tensors": {n: d.as_json() for n, d in self.tensors.items()},
                "summary": summary}


def group(name: str) -> str:
    """The module group a tensor belongs to, for the summary."""
    if "lora_" in name:
        return "adapters"
    if any(part in name for part in _TOWER):
        return "tower"
    if any(part in name for part in _PROJECTOR):
        return "projector"
    block = _BLOCK.search(name)
    if block:
        return f"block {int(block.group(1))}"
    if any(part in name for part in _EMBED):
        return "embeddings"
    if any(name.endswith(part) or f"{part}." in name for part in _HEAD):
        return "head"
    return "other"


def diff(a: Path, b: Path, *, tolerance: float = 0.0) -> DiffReport:
    """Every tensor of ``a`` and ``b`` compared (``tolerance``: the largest |Δ| still ``close``); for two
    checkpoints of ours, their recipes' and counters' differences too."""
    report = DiffReport(str(a), str(b))
    with ExitStack() as stack:
        left, right = _sides(Path(a), Path(b), stack)
        for name in sorted(set(left.shapes) | set(right.shapes)):
            report.tensors[name] = _tensor(left, right, name, tolerance)
    ckpt_a, ckpt_b = _checkpoint(Path(a)), _checkpoint(Path(b))
    if ckpt_a is not None and ckpt_b is not None:
        recipe_a, recipe_b = (_read(CheckpointFolder(c).config, "yaml") for c in (ckpt_a, ckpt_b))
        if recipe_a is not None and recipe_b is not None:
            report.recipe = _differences(recipe_a, recipe_b)
        meta_a, meta_b = (_read(CheckpointFolder(c).metadata, "json") for c in (ckpt_a, ckpt_b))
        if meta_a is not None and meta_b is not None:
            flat_a, flat_b = _flat(meta_a), _flat(meta_b)
            report.counters = {k: (flat_a.get(k), flat_b.get(k)) for k in _counter_keys(flat_a, flat_b)
                               if flat_a.get(k) != flat_b.get(k)}
            stages = _stage(meta_a), _stage(meta_b)
            if stages[0] != stages[1]:  # a run in stages (docs/stages.md): the stage each side is in
                report.counters["stage"] = stages
    return report


def _sides(a: Path, b: Path, stack: ExitStack) -> tuple[ModelSource, ModelSource]:
    """The two sides' tensors: each as ``open_tensors`` reads it, an export target's file by the other side's names
    (two such files by their own)."""
    file_a, file_b = identify(a), identify(b)
    if file_a and file_b:
        return file_a.open_tensors(a, stack), file_b.open_tensors(b, stack)
    if file_a:
        laid, read = file_a.beside(stack.enter_context(open_tensors(b)), a, stack)
        return read, laid
    if file_b:
        return file_b.beside(stack.enter_context(open_tensors(a)), b, stack)
    return stack.enter_context(open_tensors(a)), stack.enter_context(open_tensors(b))


def _tensor(left: ModelSource, right: ModelSource, name: str, tolerance: float) -> TensorDiff:
    if name not in right.shapes:
        return TensorDiff(ONLY_A)
    if name not in left.shapes:
        return TensorDiff(ONLY_B)
    if left.shapes[name] != right.shapes[name]:
        return TensorDiff(CHANGED, note=f"shape {list(left.shapes[name])} -> {list(right.shapes[name])}")
    x, y = left.read_saved(name), right.read_saved(name)
    stored = left.formats.get(name) or right.formats.get(name)  # one side quantized: how it is stored
    note = stored or ("" if x.dtype == y.dtype else f"dtype {str(x.dtype).removeprefix('torch.')} -> "
                                                     f"{str(y.dtype).removeprefix('torch.')}")
    if x.dtype == y.dtype and torch.equal(x, y):
        return TensorDiff(EQUAL, 0.0, 0.0, 0.0)
    if not (x.is_floating_point() and y.is_floating_point()):
        changed = (x.to(torch.int64) != y.to(torch.int64)).double().mean().item() if x.dtype != torch.bool else None
        return TensorDiff(CHANGED, changed_fraction=changed, note=note)
    xd, yd = x.double(), y.double()
    delta = yd - xd
    max_abs = float(delta.abs().max()) if delta.numel() else 0.0
    norm = float(xd.norm())
    rel = float(delta.norm()) / norm if norm else (0.0 if max_abs == 0 else math.inf)
    fraction = float((delta != 0).double().mean()) if delta.numel() else 0.0
    close = max_abs <= tolerance or _rounds_to(x, y)
    if not close and stored:  # within both sides' rounding (module docstring)
        close = bool((delta.abs() <= left.rounding(name, x) + right.rounding(name, y) + tolerance).all())
    status = CLOSE if close else CHANGED
    return TensorDiff(status, max_abs, rel, fraction, note)


def _rounds_to(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether one side is the other rounded to its coarser dtype (a checkpoint and its bf16 export)."""
    if x.dtype == y.dtype:
        return False
    fine, coarse = (x, y) if torch.finfo(x.dtype).eps < torch.finfo(y.dtype).eps else (y, x)
    return torch.equal(fine.to(coarse.dtype), coarse)


def _checkpoint(src: Path) -> Path | None:
    """``src`` as a checkpoint of ours (its folder: one with a ``metadata.json`` entry of any kind), or None (an
    export, an archive, an adapter folder)."""
    for folder in (src, src.parent if src.name == CheckpointFolder.model else None):
        if folder is not None and folder.is_dir() and os.path.lexists(CheckpointFolder(folder).metadata):
            return folder
    return None


def _read(path: Path, kind: str) -> dict[str, Any] | None:
    """A checkpoint's recipe or metadata (None: the checkpoint has none). Only a regular file is read: a link, a
    FIFO, a device or a folder in its place is a one-line ``CheckpointError``, never followed or opened."""
    what = "a checkpoint's recipe" if kind == "yaml" else "a checkpoint's metadata"
    try:
        why = regular_file_problem(path)
        if why is not None:
            raise CheckpointError(f"'{path}' is {why}; diff reads {what} only from a regular file")
        value = read_yaml(path, what, CONFIG_FILE_LIMIT) if kind == "yaml" else read_json(path, what, SMALL_FILE_LIMIT)
    except FileNotFoundError:
        return None
    except OSError as exc:  # unreadable, or replaced while read
        raise CheckpointError(f"cannot read '{path}' ({what}): {exc.strerror or first_line(exc)}") from None
    return value if isinstance(value, dict) else {}


def _stage(meta: dict[str, Any]) -> str | None:
    """The stage a checkpoint's metadata says it is in, ``anneal (from step 21)``; None for a run without stages (or
    a list of stages that fails its checks)."""
    from automodel_ckpt.training.stages import read_history

    try:
        stages, _ = read_history(meta, "metadata")
    except UserError:
        return None
    return f"{stages[-1]['name']} (from step {stages[-1]['first_step']})" if stages else None


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out |= _flat(value, f"{prefix}.{key}" if prefix else str(key))
    return out


def _differences(a: dict[str, Any], b: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    fa, fb = _flat(a), _flat(b)
    return {k: (fa.get(k), fb.get(k)) for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)}


def _counter_keys(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Of two flattened metadata records, the counters and data position: the known counters wherever they sit,
    and ``data`` entries."""
    keys = set(a) | set(b)
    return sorted(k for k in keys if k.rsplit(".", 1)[-1] in _COUNTERS or k.startswith(("data.", "counters.")))
