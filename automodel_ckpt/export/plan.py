"""Export a checkpoint's sharded model to a Hugging Face folder, streaming, dtype-faithful and atomic.

``consolidate(model_dir)`` turns ``model/`` (per-rank safetensors shards or DCP files) into ``model/consolidated/``
with the config and tokenizer kept in ``model/.hf_metadata``. With a base from an HF folder, every tensor returns to
its original dtype and file number, so the export diffs cleanly against the base; names and layout are those
``save_pretrained`` gives the family. Tensors stream piece by piece (the model is never held in memory) into a
hidden sibling folder, renamed into place when complete.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import sys
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from automodel_ckpt.ondisk import (ST_TO_TORCH, CheckpointFolder, HFFolder, ModelFolder, copy_regular,
                                   detect_model_format, export_error, exported_format, is_plain_float, not_regular,
                                   write_durable)
from automodel_ckpt.export.commit import make_coordinator
from automodel_ckpt.export.script import render_consolidate_script
from automodel_ckpt.export.sources import ShardSource, open_source
from automodel_ckpt.export.writer import OutFile, OutTensor, total_bytes, write_files
from automodel_ckpt.export.views import on_disk_tensors
from automodel_ckpt.export.hf_metadata import HFMetadata, read_hf_metadata
from automodel_ckpt.errors import CheckpointError, UserError
from automodel_ckpt.sizes import human_size, in_groups

__all__ = ["CAST_DTYPES", "consolidate", "parse_cast_dtype", "render_consolidate_script", "resolve_model_dir"]

logger = logging.getLogger(__name__)

CAST_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
                                       "fp64": torch.float64}
_CAST_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32",
                 "float64": "fp64", "double": "fp64"}  # fmt: skip


def parse_cast_dtype(value: str | None) -> torch.dtype | None:
    """``"bf16"`` -> ``torch.bfloat16``; None or empty -> None (restore original dtypes)."""
    if value is None or not str(value).strip():
        return None
    key = str(value).strip().lower()
    key = _CAST_ALIASES.get(key, key)
    if key not in CAST_DTYPES:
        raise UserError(f"unknown CAST_DTYPE '{value}'; use one of {', '.join(CAST_DTYPES)}")
    return CAST_DTYPES[key]


def resolve_model_dir(path: Path) -> Path:
    """Accept a checkpoint folder (``epoch_0_step_4``) or its ``model/`` folder; return the one holding shards."""
    path = Path(path)
    inner = CheckpointFolder(path).model.path
    if inner.is_symlink():
        raise CheckpointError(f"'{inner}' is a symlink, not a folder; folders inside a checkpoint are never "
                              "followed as links")
    if detect_model_format(path) is None and inner.is_dir():
        _refuse_links(inner)  # a shard that is a link, a FIFO, a device or a folder is named, not passed over
        if detect_model_format(inner) is not None:
            return inner
    return path


def consolidate(model_dir: Path, out_dir: Path | None = None, *, cast_dtype: str | None = None, num_threads: int = 5,
                max_shard_size: int = 5 * 2**30, rank: int = 0, world_size: int = 1, progress: bool = True,
                metadata_dir: Path | None = None) -> Path:
    """Export the model in ``model_dir`` to ``out_dir`` (default ``model_dir/consolidated``); returns ``out_dir``.

    A floating tensor gets ``cast_dtype``, else its base model's dtype, else its saved one (fp8 and integer tensors
    are never cast); it goes to its file number in the base, else files of at most ``max_shard_size`` bytes.

    With ``world_size > 1`` every rank calls this and writes its share of the files (byte-identical to one
    process); ranks meet through torch.distributed when it is initialised with that world size, else through
    marker files (rank 0 waits for the others' before it renames the folder).

    ``metadata_dir``: the ``model/`` folder whose ``.hf_metadata`` describes shards saved apart from it (a
    checkpoint's ``ema/``), which must then hold every tensor of the model."""
    model_dir = resolve_model_dir(Path(model_dir)) if metadata_dir is None else Path(model_dir)
    out_dir = Path(out_dir) if out_dir is not None else ModelFolder(model_dir).consolidated.path
    cast = parse_cast_dtype(cast_dtype)
    if world_size < 1 or not 0 <= rank < world_size:
        raise UserError(f"bad rank {rank} for world size {world_size}")
    if max_shard_size <= 0:
        raise UserError(f"max shard size must be positive, got {max_shard_size}")
    exported_format(model_dir)  # before anything is created next to it
    _check_out_dir(model_dir, out_dir)
    coordinator = make_coordinator(out_dir, rank, world_size)
    tmp = coordinator.begin()
    plan: ExportPlan | None = None
    error: BaseException | None = None
    try:
        start = time.perf_counter()
        plan = build_plan(model_dir, cast, max_shard_size, metadata_dir)
        mine = plan.files_for_rank(rank, world_size)
        nbytes = total_bytes(mine)
        with progress_bar(nbytes, progress and rank == 0) as advance:
            write_files(mine, tmp, num_threads, advance)
        if rank == 0:
            plan.write_side_files(tmp)
        elapsed = time.perf_counter() - start
        logger.info("rank %d wrote %d file(s), %s in %.1f s (%s/s)", rank, len(mine), human_size(nbytes), elapsed,
                    human_size(int(nbytes / max(elapsed, 1e-9))))
    except BaseException as e:  # noqa: BLE001 - every rank must take part in the final step, even after a failure
        error = export_error(e, out_dir, total_bytes(plan.files_for_rank(0, 1)) if plan else None)
    coordinator.end(error, plan)
    return out_dir


def _check_out_dir(model_dir: Path, out_dir: Path) -> None:
    """An existing ``out_dir`` gets replaced: allow that only for an earlier export, never for the shards' folder."""
    model_real, out_real = model_dir.resolve(), out_dir.resolve()
    if out_real == model_real or out_real in model_real.parents:
        raise UserError(f"output folder {out_dir} must not be the model folder or contain it")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not HFFolder(out_dir).index.is_file():
        raise UserError(f"output folder {out_dir} exists and is not an earlier export; remove it or choose another")


# ---------------------------------------------------------------------------------------------- planning
@dataclass
class ExportPlan:
    """What every output file holds, in which dtype and at which offset; identical on every rank."""

    source: ShardSource
    files: list[OutFile]
    config: dict[str, Any] | None
    extra_files: list[Path] = field(default_factory=list)

    def files_for_rank(self, rank: int, world_size: int) -> list[OutFile]:
        """Deterministic split by bytes: largest file first, each to the least loaded rank (lowest on ties)."""
        loads = [0] * world_size
        owner: dict[str, int] = {}
        for f in sorted(self.files, key=lambda f: (-f.size, f.name)):
            r = min(range(world_size), key=lambda i: (loads[i], i))
            owner[f.name] = r
            loads[r] += f.size
        return [f for f in self.files if owner[f.name] == rank]

    def expected_names(self) -> set[str]:
        names = {f.name for f in self.files} | {HFFolder.index} | {p.name for p in self.extra_files}
        return names | ({HFFolder.config} if self.config is not None else set())

    def fingerprint(self) -> str:
        """Identifies this exact export (sources, files, dtypes); ranks agree on it before the rename."""
        desc = {"sources": self.source.fingerprint(),
                "files": [[f.name, [[t.name, str(t.dtype), t.offset] for t in f.tensors]] for f in self.files]}
        return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()

    def index(self) -> dict[str, Any]:
        weight_map = {t.name: f.name for f in self.files for t in f.tensors}
        total_size = sum(t.nbytes for f in self.files for t in f.tensors)
        params = sum(t.source.numel for f in self.files for t in f.tensors)
        return {"metadata": {"total_size": total_size, "total_parameters": params},
                "weight_map": dict(sorted(weight_map.items()))}

    def write_side_files(self, folder: Path) -> None:
        """Index, config and the files kept in ``.hf_metadata`` (rank 0 only)."""
        for name, content in self.side_files():
            if isinstance(content, Path):
                copy_regular(content, folder / name)  # never through a link: a FIFO or symlink is refused
            else:
                write_durable(folder / name, content)

    def side_files(self) -> list[tuple[str, str | Path]]:
        """``(name, text or the file to copy)`` of every file of the export besides the weights."""
        out: list[tuple[str, str | Path]] = [(HFFolder.index, json.dumps(self.index(), indent=2, sort_keys=True)
                                              + "\n")]
        if self.config is not None:
            out.append((HFFolder.config, json.dumps(self.config, indent=2, sort_keys=True) + "\n"))
        return out + [(path.name, path) for path in self.extra_files]


def build_plan(model_dir: Path, cast: torch.dtype | None, max_shard_size: int,
               metadata_dir: Path | None = None) -> ExportPlan:
    """Decide every tensor's output dtype, file and offset from the shard headers and ``.hf_metadata`` (of
    ``metadata_dir`` when given: the model's, for shards saved apart from it; see ``consolidate``)."""
    _refuse_links(model_dir)
    if metadata_dir is not None and not ModelFolder(metadata_dir).hf_metadata.is_dir():
        raise CheckpointError(f"'{metadata_dir}' has no {ModelFolder.hf_metadata} to describe '{model_dir}' (a LoRA "
                              "checkpoint's EMA holds adapter weights, which are not exported)")
    meta = _read_metadata(model_dir if metadata_dir is None else Path(metadata_dir))
    if meta is not None and metadata_dir is not None:
        meta = replace(meta, saved=None)  # the model's saved shapes, not these shards'
    source = open_source(model_dir, meta.saved if meta else None, meta.saved_world_size if meta else None)
    source.tensors = on_disk_tensors(source.tensors, meta.config if meta else None,
                                     list(meta.original) if meta and meta.original else None)
    original = meta.original if meta else None
    if metadata_dir is not None and original:
        _require_every_tensor(model_dir, source, original)
    dtypes = _output_dtypes(source, original, cast)
    tensors = [OutTensor(source.tensors[name], dtypes[name]) for name in sorted(source.tensors, key=_natural_key)]
    if original is not None and meta is not None and meta.original_num_files:
        files = _files_like_base(tensors, original, meta.original_num_files)
    else:
        files = _files_by_size(tensors, max_shard_size)
    for f in files:
        f.lay_out()
    config = dict(meta.config) if meta and meta.config is not None else None
    if config is not None:
        _set_config_dtype(config, files)
    return ExportPlan(source, files, config, meta.extra_files if meta else [])


def _require_every_tensor(model_dir: Path, source: ShardSource, original: dict) -> None:
    """A ``CheckpointError`` unless the shards hold every tensor of the model (an EMA of a run with frozen
    weights or a LoRA adapter holds only what trained)."""
    missing = sorted(set(original) - set(source.tensors), key=_natural_key)
    if missing:
        raise CheckpointError(f"'{model_dir}' holds {len(original) - len(missing)} of the model's {len(original)} "
                              f"tensors ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''} missing: "
                              "only trainable weights are averaged); a Hugging Face folder needs all of them")


def _refuse_links(model_dir: Path) -> None:
    """A ``CheckpointError`` naming the first link, FIFO, socket or device among ``model_dir``'s files, or a folder
    bearing a shard's or the DCP index's name: an export reads only regular files, never through a link."""
    try:
        with os.scandir(model_dir) as it:
            entries = list(it)
    except OSError as exc:
        raise CheckpointError(f"cannot read the folder '{model_dir}': {exc.strerror or exc}") from None
    for entry in sorted(entries, key=lambda e: e.name):
        if entry.is_dir(follow_symlinks=False) and not _is_model_file_name(entry.name):
            continue
        why = not_regular(entry.stat(follow_symlinks=False).st_mode)
        if why is not None:
            raise CheckpointError(f"'{entry.path}' is {why}; an export reads only the regular files of a "
                                  "checkpoint, never through a link: replace it with the file itself")


def _is_model_file_name(name: str) -> bool:
    return name.endswith(".safetensors") or ModelFolder.is_dcp_data_file(name) or name == ModelFolder.dcp_metadata


def _read_metadata(model_dir: Path) -> HFMetadata | None:
    if not ModelFolder(model_dir).hf_metadata.is_dir():
        logger.warning("%s has no %s folder: the export gets weights and index only (no %s, no tokenizer)",
                       model_dir, ModelFolder.hf_metadata, HFFolder.config)
        return None
    return read_hf_metadata(model_dir)


def _output_dtypes(source: ShardSource, original: dict | None, cast: torch.dtype | None) -> dict[str, torch.dtype]:
    """The dtype rule: cast > original > saved for floating tensors; fp8 and integer tensors keep their dtype."""
    out: dict[str, torch.dtype] = {}
    unrestorable: list[str] = []
    for name, tensor in source.tensors.items():
        saved = tensor.dtype
        if not is_plain_float(saved):
            out[name] = saved
            continue
        orig_info = original.get(name) if original else None
        orig = ST_TO_TORCH.get(orig_info.dtype) if orig_info else None
        if orig_info is not None and (orig is None or not is_plain_float(orig)):
            unrestorable.append(f"{name} ({orig_info.dtype})")  # quantized/packed in the base: not re-quantized
            orig = None
        out[name] = cast or orig or saved
    if unrestorable:
        warnings.warn(f"{len(unrestorable)} tensor(s) were quantized or packed in the base model but are saved as "
                      f"floats; they are exported as floats, not re-quantized: {', '.join(unrestorable[:5])}"
                      + (" ..." if len(unrestorable) > 5 else ""), stacklevel=3)  # the CLI shows it in one line
    return out


def _files_like_base(tensors: list[OutTensor], original: dict, num_files: int) -> list[OutFile]:
    """Each tensor in the same file number as in the base model; tensors new since the base go to the last file."""
    files = [OutFile(HFFolder.weights_name(k, num_files)) for k in range(1, num_files + 1)]
    new = []
    for t in tensors:
        info = original.get(t.name)
        number = info.file if info is not None and info.file and 1 <= info.file <= num_files else num_files
        if info is None:
            new.append(t.name)
        files[number - 1].tensors.append(t)
    if new:
        logger.info("%d tensor(s) not in the base model go to the last file: %s", len(new), ", ".join(new[:5]))
    return files


def _files_by_size(tensors: list[OutTensor], max_shard_size: int) -> list[OutFile]:
    """Greedy split in name order (natural sort): a new file starts when the next tensor would not fit."""
    groups = in_groups(tensors, lambda t: t.nbytes, max_shard_size) or [[]]
    return [OutFile(HFFolder.weights_name(k, len(groups)), g) for k, g in enumerate(groups, start=1)]


def _set_config_dtype(config: dict[str, Any], files: list[OutFile]) -> None:
    """config.json names the dtype most floating parameters are exported in."""
    counts: Counter[torch.dtype] = Counter()
    for f in files:
        for t in f.tensors:
            if is_plain_float(t.dtype):
                counts[t.dtype] += t.source.numel
    if not counts:
        return
    name = str(counts.most_common(1)[0][0]).removeprefix("torch.")
    config["dtype"] = name
    if "torch_dtype" in config:
        config["torch_dtype"] = name


def _natural_key(name: str) -> list[Any]:
    """``layers.2`` before ``layers.10``: files group whole layers in model order."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


@contextmanager
def progress_bar(total: int, enabled: bool, desc: str = "consolidating") -> Iterator[Callable[[int], None]]:
    """``advance(n)`` of a tqdm bar over output bytes (any thread), shown only when asked and stderr is a terminal."""
    if not (enabled and sys.stderr.isatty()):
        yield lambda n: None
        return
    from tqdm import tqdm

    lock = threading.Lock()
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc) as bar:
        def advance(n: int) -> None:
            with lock:
                bar.update(n)

        yield advance
