"""Where each piece of each tensor lives in a model folder's shards (safetensors or DCP), checked for coverage.

Only headers and DCP metadata are read here; tensor bytes are read later, one piece at a time, by the writer.
"""

from __future__ import annotations

import io
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from automodel_ckpt.ondisk import bounded, layout, paths
from automodel_ckpt.ondisk.formats.detect import detect_model_format
from automodel_ckpt.export.hf_metadata import TensorInfo
from automodel_ckpt.ondisk.formats.safetensors_io import ST_TO_TORCH, numel, pread_into, read_header, tensor_entries
from automodel_ckpt.ondisk.layout import SAFETENSORS, TORCH_SAVE
from automodel_ckpt.errors import CheckpointError

logger = logging.getLogger(__name__)

_SHARDING_INFO_KEY = "DCP_SHARDING_INFO"
_SAVED_OFFSETS_KEY = "saved_offsets"


@dataclass(frozen=True)
class Piece:
    """One rank's part of a tensor: a box at ``offsets`` of size ``shape`` inside the full tensor.

    safetensors pieces are raw C-order bytes at ``[start, start + length)`` of ``file``; DCP pieces are a
    ``torch.save`` payload there (``raw`` False), possibly with stream transforms (``transforms``); ``select``
    then takes elements ``[a, b)`` of the stored payload (a piece cut to part of an exported tensor).
    """

    file: Path
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    start: int
    length: int
    raw: bool = True
    transforms: tuple[str, ...] = ()
    select: tuple[int, int] | None = None

    @property
    def numel(self) -> int:
        return numel(self.shape)


@dataclass
class SourceTensor:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: list[Piece] = field(default_factory=list)
    base_shape: tuple[int, ...] | None = None
    """Set for a strided view of a saved tensor: ``pieces`` tile a tensor of this shape, ..."""
    view: tuple[int, tuple[int, ...]] | None = None
    """... and this tensor is its ``as_strided(shape, stride, offset)`` view, given as ``(offset, stride)``."""

    @property
    def numel(self) -> int:
        return numel(self.shape)


@dataclass
class ShardSource:
    """All tensors of one model folder, by name, with the pieces that make them up."""

    folder: Path
    format: str
    tensors: dict[str, SourceTensor]
    files: list[Path]

    def fingerprint(self) -> list[tuple[str, int, int]]:
        """Name, size and mtime of every shard file: identifies this exact set of shards."""
        out = []
        for f in self.files:
            st = f.stat()
            out.append((f.name, st.st_size, st.st_mtime_ns))
        return out


def require_format(folder: Path) -> str:
    """The format of ``folder``'s shards; a CheckpointError when it is absent or holds none."""
    if (folder / layout.ADAPTER_CONFIG).exists():
        raise CheckpointError(
            f"{folder} holds a PEFT adapter, not model shards; use `ckpt-train merge-lora` for a full HF model"
        )
    fmt = detect_model_format(folder)
    if fmt is None or fmt == layout.ADAPTER_FORMAT:
        if not folder.exists():
            raise CheckpointError(f"model folder {folder} does not exist")
        raise CheckpointError(
            f"no model shards in {folder}: expected shard-*.safetensors files or a DCP {layout.DCP_METADATA} file"
        )
    return fmt


def open_source(
    folder: Path, saved: dict[str, TensorInfo] | None = None, saved_world_size: int | None = None
) -> ShardSource:
    """Index the shards of ``folder``.

    ``saved`` (full shapes recorded at save time) makes the coverage check exact; ``saved_world_size`` (ranks
    that wrote safetensors shards) catches a missing last shard file, which the other files cannot reveal.

    Raises CheckpointError naming the file for a missing, truncated or damaged shard, and for tensors whose
    pieces overlap or leave gaps.
    """
    folder = Path(folder)
    fmt = require_format(folder)
    source = _open_safetensors(folder, saved_world_size) if fmt == SAFETENSORS else _open_dcp(folder)
    _apply_saved_shapes(source, saved)
    for tensor in source.tensors.values():
        _drop_replicas(tensor)
        check_coverage(tensor, folder)
    return source


# ---------------------------------------------------------------------------------------------- safetensors
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
            if end - begin != numel(shape) * dtype.itemsize:
                raise CheckpointError(f"damaged shard file {path}: byte range of '{name}' does not match its shape")
            noted = sharding.get(name)
            offsets = noted.get(_SAVED_OFFSETS_KEY, [0] * len(shape)) if isinstance(noted, dict) else [0] * len(shape)
            if not isinstance(offsets, list) or len(offsets) != len(shape) or not all(_is_index(o) for o in offsets):
                raise CheckpointError(f"damaged shard file {path}: offsets of '{name}' do not match its shape")
            piece = Piece(path, tuple(offsets), shape, data_start + begin, end - begin)
            tensor = tensors.get(name)
            if tensor is None:
                tensors[name] = tensor = SourceTensor(name, (), dtype)
            elif tensor.dtype != dtype:
                raise CheckpointError(f"shard file {path}: '{name}' is {dtype} here but {tensor.dtype} elsewhere")
            tensor.pieces.append(piece)
    for tensor in tensors.values():
        dims = {len(p.shape) for p in tensor.pieces}
        if len(dims) != 1:
            raise CheckpointError(f"shard files in {folder} disagree on the number of dimensions of '{tensor.name}'")
        tensor.shape = tuple(max(p.offsets[d] + p.shape[d] for p in tensor.pieces) for d in range(dims.pop()))
    return ShardSource(folder, SAFETENSORS, tensors, files)


def _sharding_info(header: dict[str, Any], path: Path) -> dict[str, Any]:
    raw = (header.get("__metadata__") or {}).get(_SHARDING_INFO_KEY)
    if raw is None:
        return {}
    if not isinstance(raw, str):
        raise CheckpointError(f"damaged shard file {path}: {_SHARDING_INFO_KEY} is not a string")
    info = bounded.parse_json(raw, f"the {_SHARDING_INFO_KEY} of shard file {path}", "sharding information",
                              bounded.SAFETENSORS_HEADER)
    return info if isinstance(info, dict) else {}


def _is_index(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


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


# ---------------------------------------------------------------------------------------------- DCP
def _open_dcp(folder: Path) -> ShardSource:
    """The pieces named by ``folder/.metadata``, read by the restricted unpickler (a pickle from a checkpoint
    never runs code; its file names stay inside ``folder``)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    from automodel_ckpt.ondisk.formats.safe_load import load_dcp_metadata

    where = folder / layout.DCP_METADATA
    metadata = load_dcp_metadata(where)  # entries counted, sizes and chunk boxes checked (safe_load.check_entries)
    storage = metadata.storage_data or {}
    tensors: dict[str, SourceTensor] = {}
    sizes: dict[str, int] = {}
    for name, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            logger.warning("skipping non-tensor entry '%s' of %s", name, folder)
            continue
        tensor = SourceTensor(name, tuple(md.size), md.properties.dtype)
        for chunk in md.chunks:
            info = storage.get(MetadataIndex(name, chunk.offsets))
            if info is None:
                raise CheckpointError(f"damaged DCP metadata in {folder}: no storage entry for a piece of '{name}'")
            rel = str(info.relative_path)  # checked by load_dcp_metadata: plain, inside the folder, regular
            path = folder / rel
            if rel not in sizes:
                try:
                    sizes[rel] = path.stat().st_size
                except FileNotFoundError:
                    raise CheckpointError(f"missing shard file {path}") from None
            if not (_is_index(info.offset) and _is_index(info.length)):
                raise CheckpointError(f"damaged DCP metadata {where}: a piece of '{name}' has no byte range")
            if info.offset + info.length > sizes[rel]:
                raise CheckpointError(
                    f"truncated shard file {path}: holds {sizes[rel]} bytes, needs {info.offset + info.length}"
                )
            transforms = tuple(getattr(info, "transform_descriptors", None) or ())
            piece = Piece(path, tuple(chunk.offsets), tuple(chunk.sizes), info.offset, info.length, False, transforms)
            if not transforms and info.length < piece.numel * tensor.dtype.itemsize:
                raise CheckpointError(f"damaged DCP metadata {where}: a piece of '{name}' claims {piece.numel} "
                                      f"elements in {info.length} bytes of {path.name}")
            tensor.pieces.append(piece)
        tensors[name] = tensor
    _check_disjoint_bytes(tensors.values(), where)
    files = sorted(folder / n for n in sizes)
    return ShardSource(folder, TORCH_SAVE, tensors, files)


def _check_disjoint_bytes(tensors: Any, where: Path) -> None:
    """No two pieces share bytes of a file (sorted by file and offset: O(n log n)): every byte an export writes is
    backed by bytes of its own in the shards."""
    ranges = sorted((p.file, p.start, p.start + p.length, t.name) for t in tensors for p in t.pieces if p.length)
    for (file_a, _, end, first), (file_b, start, _, second) in zip(ranges, ranges[1:]):
        if file_a == file_b and start < end:
            raise CheckpointError(f"damaged DCP metadata {where}: pieces of '{first}' and '{second}' share bytes "
                                  f"of {file_a.name}")


def read_piece(piece: Piece) -> bytearray:
    """The stored bytes of one DCP piece, read with one positioned read."""
    buf = bytearray(piece.length)
    fd = paths.open_regular(Path(piece.file))
    try:
        pread_into(fd, memoryview(buf), piece.start, piece.file)
    finally:
        os.close(fd)
    return buf


def load_dcp_piece(piece: Piece) -> torch.Tensor:
    """The tensor stored for one DCP piece (a ``torch.save`` payload), read with one positioned read."""
    stream: io.IOBase = io.BytesIO(read_piece(piece))
    if piece.transforms:
        stream = _untransform(piece, stream)
    try:
        tensor = torch.load(stream, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for damaged payloads
        raise CheckpointError(f"damaged shard file {piece.file}: cannot read a piece at byte {piece.start} ({e})") from None
    if piece.select is not None:
        a, b = piece.select
        if b - a != math.prod(piece.shape) or b > tensor.numel():
            raise CheckpointError(f"damaged shard file {piece.file}: piece at byte {piece.start} is too small")
        tensor = tensor.reshape(-1)[a:b].view(piece.shape)
    if tuple(tensor.shape) != piece.shape:
        raise CheckpointError(f"damaged shard file {piece.file}: piece at byte {piece.start} has the wrong shape")
    return tensor.contiguous()


def _untransform(piece: Piece, stream: io.IOBase) -> io.IOBase:
    """Undo DCP stream extensions (e.g. compression) recorded for a piece."""
    try:
        from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension
    except ImportError:
        raise CheckpointError(f"{piece.file}: pieces use DCP stream transforms this torch cannot read") from None
    for ext in ExtensionRegistry().from_descriptor_list(list(piece.transforms)):
        if isinstance(ext, StreamTransformExtension):
            stream = ext.transform_from(stream)
    return io.BytesIO(stream.read())


# ---------------------------------------------------------------------------------------------- checks
def _apply_saved_shapes(source: ShardSource, saved: dict[str, TensorInfo] | None) -> None:
    """Trust the full shapes recorded at save time over shapes inferred from the pieces found."""
    if not saved:
        return
    for name, info in saved.items():
        tensor = source.tensors.get(name)
        if tensor is None:
            raise CheckpointError(f"tensor '{name}' is missing from the shard files in {source.folder}")
        if len(info.shape) != len(tensor.shape) or any(a > b for a, b in zip(tensor.shape, info.shape)):
            raise CheckpointError(
                f"tensor '{name}' in {source.folder} has pieces outside its saved shape {list(info.shape)}"
            )
        tensor.shape = info.shape


def _drop_replicas(tensor: SourceTensor) -> None:
    """Keep one of several pieces with the same box: replicated (unsharded) tensors may be saved by every rank."""
    seen: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
    kept = []
    for p in tensor.pieces:
        if (p.offsets, p.shape) not in seen:
            seen.add((p.offsets, p.shape))
            kept.append(p)
    tensor.pieces = kept


_PAIRWISE_MAX = 512  # pieces whose boxes are compared pair by pair where they form no grid (about 10^5 pairs)


def check_coverage(tensor: SourceTensor, folder: Path) -> None:
    """The pieces of a tensor must tile it exactly: inside its bounds, no overlap, no gap.

    Pieces form a grid (or bands split again inside each band) in every sharded layout: they are grouped by
    their range in one dimension after another, each level sorted, so the check takes O(n log n); only pieces
    whose ranges overlap without being equal are compared pair by pair, at most ``_PAIRWISE_MAX`` of them."""
    shape = tensor.shape
    pieces = [p for p in tensor.pieces if p.numel > 0]
    for p in pieces:
        if len(p.offsets) != len(shape) or len(p.shape) != len(shape) \
                or any(o < 0 or o + s > d for o, s, d in zip(p.offsets, p.shape, shape)):
            raise CheckpointError(f"shard file {p.file}: a piece of '{tensor.name}' lies outside the tensor")
    pair = _first_overlap(pieces, 0, tensor.name, folder)
    if pair is not None:
        a, b = pair
        where = f"(one in {a.file})" if a.file == b.file else f"in {a.file} and {b.file}"
        raise CheckpointError(f"overlapping pieces of '{tensor.name}' {where}")
    covered = sum(p.numel for p in pieces)
    if covered == math.prod(shape):
        return
    row_split = all(p.offsets[1:] == (0,) * (len(shape) - 1) and p.shape[1:] == shape[1:] for p in pieces)
    if shape and row_split:
        end = 0
        for p in sorted(pieces, key=lambda p: p.offsets[0]):
            if p.offsets[0] > end:
                break
            end = p.offsets[0] + p.shape[0]
        stop = min([p.offsets[0] for p in pieces if p.offsets[0] > end] + [shape[0]])
        raise CheckpointError(
            f"rows {end}..{stop} of '{tensor.name}' are in no shard file in {folder} (missing shard file?)"
        )
    raise CheckpointError(
        f"'{tensor.name}' is only partly covered by the shard files in {folder} "
        f"({covered} of {math.prod(shape)} elements; missing shard file?)"
    )


def _first_overlap(pieces: list[Piece], dim: int, name: str, folder: Path) -> tuple[Piece, Piece] | None:
    """Two pieces whose boxes overlap, or None: pieces with the same range in ``dim`` are checked in the next
    dimension; groups whose ranges overlap without being equal are compared pair by pair."""
    if len(pieces) < 2:
        return None
    if dim == len(pieces[0].shape):
        return pieces[0], pieces[1]  # the same box twice (in different files: replicas were dropped before)
    groups: dict[tuple[int, int], list[Piece]] = {}
    for p in pieces:
        groups.setdefault((p.offsets[dim], p.offsets[dim] + p.shape[dim]), []).append(p)
    ranges = sorted(groups)
    cluster: list[tuple[int, int]] = []
    end = -1
    for r in [*ranges, None]:
        if r is not None and r[0] < end:
            cluster.append(r)
            end = max(end, r[1])
            continue
        if len(cluster) == 1:
            found = _first_overlap(groups[cluster[0]], dim + 1, name, folder)
        else:
            found = _pairwise([p for c in cluster for p in groups[c]], name, folder) if cluster else None
        if found is not None:
            return found
        if r is not None:
            cluster, end = [r], r[1]
    return None


def _pairwise(pieces: list[Piece], name: str, folder: Path) -> tuple[Piece, Piece] | None:
    if len(pieces) > _PAIRWISE_MAX:
        raise CheckpointError(f"the {len(pieces)} pieces of '{name}' in {folder} form no grid; more than "
                              f"{_PAIRWISE_MAX} such pieces are not checked for overlap, so they are not exported")
    for i, a in enumerate(pieces):
        for b in pieces[i + 1:]:
            if all(x < y + t and y < x + s for x, s, y, t in zip(a.offsets, a.shape, b.offsets, b.shape)):
                return a, b
    return None
