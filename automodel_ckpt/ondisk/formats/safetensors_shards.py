"""The ``safetensors`` model format: per-rank Hugging Face safetensors shards, the default.

Every rank writes its own ``shard-0000R-...`` file; a folder of plain Hugging Face weights reads as this format too."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from automodel_ckpt.errors import CheckpointError
from automodel_ckpt.ondisk import bounded, layout
from automodel_ckpt.ondisk import fastio
from automodel_ckpt.ondisk.formats.pieces import Piece, ShardSource, SourceTensor
from automodel_ckpt.ondisk.formats.safetensors_io import ST_TO_TORCH, read_header, tensor_entries
from automodel_ckpt.ondisk.formats.sharded import ShardsFormat

NAME = "safetensors"
_SHARDING_INFO_KEY = "DCP_SHARDING_INFO"
_SAVED_OFFSETS_KEY = "saved_offsets"


class SafetensorsShards(ShardsFormat):
    name = NAME
    files = "shard-*.safetensors files"
    exports_inline = True
    holds_adapters = True

    def detect(self, folder: Path) -> bool:
        return any(p.is_file() for p in Path(folder).glob("*.safetensors"))

    def storage_writer(self, path: Path, written: Any, *, small_apart: bool = False, **extra: Any):
        return fastio.ParallelSafetensorsWriter(path, written=written, **extra)

    def storage_reader(self, path: Path, check: Any = None):
        return fastio.ParallelHFReader(path, check=check)

    def open_source(self, folder: Path, saved_world_size: int | None = None) -> ShardSource:
        return _open_safetensors(Path(folder), saved_world_size)


FORMAT = SafetensorsShards()


def _safetensors_files(folder: Path) -> list[Path]:
    """Per-rank shard files, or (for a folder saved from full tensors) plain HF weight files."""
    files = sorted(p for p in folder.glob("*.safetensors") if p.is_file())
    shards = [p for p in files if layout.parse_model_shard_file(p.name) is not None]
    return shards or files


def _open_safetensors(folder: Path, saved_world_size: int | None) -> ShardSource:
    files = _safetensors_files(folder)
    _check_rank_files(folder, files, saved_world_size)
    tensors: dict[str, SourceTensor] = {}
    for path in files:
        header, data_start = read_header(path)  # entries checked: known dtype, shape = bytes, disjoint, inside
        entries = tensor_entries(header)
        sharding = _sharding_info(header, path)
        for name, entry in entries.items():
            try:
                dtype = ST_TO_TORCH[entry["dtype"]]
                shape = tuple(int(d) for d in entry["shape"])
                begin, end = (int(x) for x in entry["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"damaged shard file {path}: unsupported entry for '{name}'") from None
            if end - begin != math.prod(shape) * dtype.itemsize:
                raise CheckpointError(f"damaged shard file {path}: byte range of '{name}' does not match its shape")
            noted = sharding.get(name)
            offsets = noted.get(_SAVED_OFFSETS_KEY, [0] * len(shape)) if isinstance(noted, dict) else [0] * len(shape)
            if not isinstance(offsets, list) or len(offsets) != len(shape) or \
                    not all(bounded.is_count(o) for o in offsets):
                raise CheckpointError(f"damaged shard file {path}: offsets of '{name}' do not match its shape")
            piece = Piece(path, tuple(offsets), shape, data_start + begin, end - begin)
            tensor = tensors.setdefault(name, SourceTensor(name, (), dtype))
            if tensor.dtype != dtype:
                raise CheckpointError(f"shard file {path}: '{name}' is {dtype} here but {tensor.dtype} elsewhere")
            tensor.pieces.append(piece)
    for tensor in tensors.values():
        dims = {len(p.shape) for p in tensor.pieces}
        if len(dims) != 1:
            raise CheckpointError(f"shard files in {folder} disagree on the number of dimensions of '{tensor.name}'")
        tensor.shape = tuple(max(p.offsets[d] + p.shape[d] for p in tensor.pieces) for d in range(dims.pop()))
    return ShardSource(folder, NAME, tensors, files)


def _sharding_info(header: dict[str, Any], path: Path) -> dict[str, Any]:
    raw = (header.get("__metadata__") or {}).get(_SHARDING_INFO_KEY)
    if raw is None:
        return {}
    if not isinstance(raw, str):
        raise CheckpointError(f"damaged shard file {path}: {_SHARDING_INFO_KEY} is not a string")
    info = bounded.parse_json(raw, f"the {_SHARDING_INFO_KEY} of shard file {path}", "sharding information",
                              bounded.SAFETENSORS_HEADER)
    return info if isinstance(info, dict) else {}


def _check_rank_files(folder: Path, files: list[Path], saved_world_size: int | None) -> None:
    """Every rank (up to the highest seen, or the recorded world size) must have written the same set of files."""
    by_rank: dict[int, set[tuple[int, int]]] = {}
    for f in files:
        parsed = layout.parse_model_shard_file(f.name)
        if parsed is not None:
            by_rank.setdefault(parsed[0], set()).add(parsed[1:])
    if not by_rank:
        return
    wanted = set().union(*by_rank.values())
    for rank in range(max(max(by_rank) + 1, saved_world_size or 0)):
        missing = sorted(wanted - by_rank.get(rank, set()))
        if missing:
            name = layout.model_shard_file(rank, *missing[0])
            raise CheckpointError(f"missing shard file {folder / name}")
