"""Where each piece of each tensor lives in a model folder's files (its format's ``open_source``), checked whole.

Only headers and metadata are read here; tensor bytes are read later, one piece at a time, by the writer.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Callable
from pathlib import Path

import torch

from automodel_ckpt.ondisk import Piece, ShardSource, SourceTensor  # noqa: F401 - the export's names
from automodel_ckpt.ondisk import exported_format, open_regular, pread_into
from automodel_ckpt.export.hf_metadata import TensorInfo
from automodel_ckpt.errors import CheckpointError


def open_source(folder: Path, saved: dict[str, TensorInfo] | None = None,
                saved_world_size: int | None = None) -> ShardSource:
    """Index the shards of ``folder``: ``CheckpointError`` naming the file for a missing, truncated or damaged
    shard, or pieces that overlap or leave gaps. ``saved`` (full shapes recorded at save time) makes the coverage
    check exact; ``saved_world_size`` catches a missing last shard file, which the other files cannot reveal."""
    folder = Path(folder)
    fmt = exported_format(folder)
    source = fmt.open_source(folder, saved_world_size)
    _apply_saved_shapes(source, saved)
    for tensor in source.tensors.values():
        _drop_replicas(tensor)
        check_coverage(tensor, folder)
    return source


def read_piece(piece: Piece) -> bytearray:
    """The stored bytes of one DCP piece, read with one positioned read."""
    buf = bytearray(piece.length)
    fd = open_regular(Path(piece.file))
    try:
        pread_into(fd, memoryview(buf), piece.start, piece.file)
    finally:
        os.close(fd)
    return buf


def read_full(tensor: SourceTensor, copy_raw: Callable[[torch.Tensor, Piece], None] | None = None) -> torch.Tensor:
    """A saved tensor assembled in memory from its pieces (safetensors byte ranges or DCP payloads); a strided view
    of a saved tensor (``views``) is taken of the whole its pieces tile. ``copy_raw(region, piece)`` puts a byte
    range's values into their region (default: one positioned read)."""
    full = torch.empty(tensor.base_shape or tensor.shape, dtype=tensor.dtype)
    for piece in tensor.pieces:
        if piece.numel == 0:
            continue
        region = full[tuple(slice(o, o + s) for o, s in zip(piece.offsets, piece.shape))]
        if not piece.raw:
            region.copy_(load_dcp_piece(piece))
        elif copy_raw is not None:
            copy_raw(region, piece)
        else:
            region.copy_(torch.frombuffer(read_piece(piece), dtype=tensor.dtype).view(piece.shape))
    return full if tensor.view is None else full.as_strided(tensor.shape, tensor.view[1], tensor.view[0])


def load_dcp_piece(piece: Piece) -> torch.Tensor:
    """The tensor stored for one DCP piece (a ``torch.save`` payload), read with one positioned read."""
    stream: io.IOBase = io.BytesIO(read_piece(piece))
    if piece.transforms:
        stream = _untransform(piece, stream)
    try:
        tensor = torch.load(stream, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for damaged payloads
        raise CheckpointError(f"damaged shard file {piece.file}: cannot read a piece at byte {piece.start} "
                              f"({e})") from None
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
    from automodel_ckpt.distributed.dcp_private import stream_extensions

    try:
        ExtensionRegistry, StreamTransformExtension = stream_extensions()
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
            raise CheckpointError(f"tensor '{name}' in {source.folder} has pieces outside its saved shape "
                                  f"{list(info.shape)}")
        tensor.shape = info.shape


def _drop_replicas(tensor: SourceTensor) -> None:
    """Keep one of several pieces with the same box: replicated (unsharded) tensors may be saved by every rank."""
    kept: dict[tuple[tuple[int, ...], tuple[int, ...]], Piece] = {}
    for p in tensor.pieces:
        kept.setdefault((p.offsets, p.shape), p)
    tensor.pieces = list(kept.values())


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
        raise CheckpointError(f"rows {end}..{stop} of '{tensor.name}' are in no shard file in {folder} (missing "
                              "shard file?)")
    raise CheckpointError(f"'{tensor.name}' is only partly covered by the shard files in {folder} "
                          f"({covered} of {math.prod(shape)} elements; missing shard file?)")


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
