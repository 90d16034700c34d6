"""The uniform or weighted mean of several models' weights, streamed tensor by tensor: what `ckpt-train average` runs.

Each tensor is accumulated in float32 (float64 where a source holds it) one source tensor at a time, as saved (a
checkpoint's training weights, not cast first), then written and dropped (``tools/bench_average.py``). Sources of
different models are refused in one line before anything is written; adapters average into an adapter.
"""

from __future__ import annotations

import math
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from automodel_ckpt.errors import UserError
from automodel_ckpt.evaluation.folder import write_folder
from automodel_ckpt.evaluation.tensors import ADAPTER, open_tensors
from automodel_ckpt.export import ModelSource
from automodel_ckpt.ondisk import is_plain_float, scan_checkpoints

__all__ = ["AverageReport", "average", "last_checkpoints", "parse_weights"]


@dataclass
class AverageReport:
    out: Path
    sources: list[str]
    weights: list[float]  # normalized: they sum to 1
    tensors: int
    bytes_written: int
    kind: str


def last_checkpoints(run_dir: Path, k: int) -> list[Path]:
    """The ``k`` newest published checkpoints of the run folder ``run_dir``, oldest first."""
    if k < 1:
        raise UserError(f"--last must be at least 1, got {k}")
    if not Path(run_dir).is_dir():
        raise UserError(f"'{run_dir}' is not a run folder (a checkpoint_dir)")
    found = scan_checkpoints(Path(run_dir))
    if len(found) < k:
        names = ", ".join(r.name for r in found) or "none"
        raise UserError(f"--last {k}: '{run_dir}' has {len(found)} checkpoint(s) ({names})")
    return [r.path for r in found[-k:]]


def parse_weights(texts: list[str] | None, n: int) -> list[float]:
    """``--weights`` (numbers, separated by spaces or commas) for ``n`` sources; uniform when not given."""
    if not texts:
        return [1.0] * n
    values = [v for text in texts for v in text.replace(",", " ").split()]
    try:
        weights = [float(v) for v in values]
    except ValueError:
        raise UserError(f"--weights: '{' '.join(values)}' are not all numbers") from None
    if len(weights) != n:
        raise UserError(f"--weights: {len(weights)} weight(s) for {n} checkpoint(s); give one per checkpoint")
    if any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
        raise UserError("--weights: each weight must be a finite number >= 0, and their sum above 0")
    return weights


def average(sources: list[Path], weights: list[float], out: Path, *, dtype: torch.dtype | None = None,
            max_shard_size: int = 5 * 2**30) -> AverageReport:
    """Write the weighted mean of ``sources``' weights into the new folder ``out``; ``dtype`` overrides the written
    dtype of floating tensors (default: each tensor's dtype in the first source)."""
    if len(sources) < 2:
        raise UserError("average needs at least two checkpoints")
    if len(weights) != len(sources):
        raise UserError(f"{len(weights)} weight(s) for {len(sources)} checkpoint(s)")
    total = float(sum(weights))
    with ExitStack() as stack:
        models = [stack.enter_context(open_tensors(Path(s))) for s in sources]
        first = models[0]
        for other in models[1:]:
            _check_same(first, other)
        entries = [(name, first.shapes[name], _out_dtype(first.dtypes[name], dtype)) for name in first.shapes]
        out_dtypes = {n: d for n, _, d in entries}
        write_folder(out, entries, lambda name: _mean(name, models, weights, total).to(out_dtypes[name]), first.side,
                     adapter=first.kind == ADAPTER, max_shard_size=max_shard_size)
        written = sum(math.prod(shape) * d.itemsize for _, shape, d in entries)
        return AverageReport(Path(out), [m.where for m in models], [w / total for w in weights], len(entries),
                             written, ADAPTER if first.kind == ADAPTER else "model")


def _out_dtype(source: torch.dtype, override: torch.dtype | None) -> torch.dtype:
    if source.is_complex or (source.is_floating_point and not is_plain_float(source)):
        raise UserError(f"tensors of dtype {source} are not averaged")
    return override if override is not None and source.is_floating_point else source


def _mean(name: str, models: list[ModelSource], weights: list[float], total: float) -> torch.Tensor:
    """The weighted mean of tensor ``name``: one source tensor in memory at a time beside the accumulator."""
    dtype = models[0].dtypes[name]
    if not dtype.is_floating_point:  # an integer buffer (a position table, a mask) is kept, never averaged
        kept = models[0].read(name)
        for model in models[1:]:
            if not torch.equal(model.read(name), kept):
                raise UserError(f"tensor '{name}' (dtype {dtype}) differs between '{models[0].where}' and "
                                f"'{model.where}'; integer tensors are not averaged")
        return kept
    wide = any(m.dtypes[name] == torch.float64 for m in models)
    acc = torch.zeros(models[0].shapes[name], dtype=torch.float64 if wide else torch.float32)
    for model, weight in zip(models, weights):
        if weight:
            tensor = model.read_saved(name)  # a checkpoint's float32 weights as trained, not cast to the base's
            acc.add_(tensor, alpha=weight)
            del tensor
    return acc.div_(total)


def _check_same(a: ModelSource, b: ModelSource) -> None:
    """One line when ``b`` is not the same model as ``a``: kind, family, tensor names, shapes, floating or not."""
    def refuse(why: str) -> None:
        raise UserError(f"'{b.where}' is not the same model as '{a.where}': {why}; only checkpoints of one model "
                        "(same tensors and shapes) are averaged")

    if (a.kind == ADAPTER) != (b.kind == ADAPTER):
        refuse(f"one is {'a LoRA adapter' if a.kind == ADAPTER else 'a full model'}, the other not")
    family_a, family_b = a.config.get("model_type"), b.config.get("model_type")
    if family_a != family_b:
        refuse(f"model_type {family_b!r} there, {family_a!r} here")
    missing = [n for n in a.shapes if n not in b.shapes]
    extra = [n for n in b.shapes if n not in a.shapes]
    if missing or extra:
        refuse(f"tensor '{(missing or extra)[0]}' is in {'one' if missing else 'the other'} only "
               f"({len(missing)} missing, {len(extra)} extra)")
    for name, shape in a.shapes.items():
        if tuple(b.shapes[name]) != tuple(shape):
            refuse(f"tensor '{name}' has shape {tuple(b.shapes[name])} there, {tuple(shape)} here")
        if a.dtypes[name].is_floating_point != b.dtypes[name].is_floating_point:
            refuse(f"tensor '{name}' is {b.dtypes[name]} there, {a.dtypes[name]} here")
