"""Source tensors for parts of saved tensors: the shard pieces an on-disk tensor is read from.

An on-disk tensor that is a run of consecutive elements of a saved one (an expert of a fused stack, a renamed
tensor) gets the saved pieces cut to that run, still streamed from the shard files; any other view (a transpose)
is read by assembling the saved tensor and taking the view (``SourceTensor.view``).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import replace
from typing import Any

from automodel_ckpt.export.sources import Piece, SourceTensor
from automodel_ckpt.ondisk import DiskTensor, c_strides, disk_layout


def on_disk_tensors(tensors: dict[str, SourceTensor], config: Mapping[str, Any] | None,
                    base_names: Collection[str] | None = None) -> dict[str, SourceTensor]:
    """``tensors`` (saved names) as the tensors ``save_pretrained`` writes for the family of ``config``, in the
    naming of the base folder whose tensor names are ``base_names`` (when known)."""
    disk = disk_layout(config, {name: (t.shape, t.dtype) for name, t in tensors.items()}, base_names)
    return tensors if disk is None else apply_disk_layout(tensors, disk)


def apply_disk_layout(tensors: Mapping[str, SourceTensor], disk: Mapping[str, DiskTensor]) -> dict[str, SourceTensor]:
    """The source tensors under their on-disk names; saved tensors the layout does not mention are left out."""
    out: dict[str, SourceTensor] = {}
    for name, view in disk.items():
        source = tensors[view.source]
        if view.is_whole(source.shape):
            out[name] = SourceTensor(name, source.shape, source.dtype, list(source.pieces))
        elif view.contiguous and all(flat_range(p, source.shape) is not None for p in source.pieces if p.numel):
            out[name] = _slice(source, view)
        else:
            out[name] = SourceTensor(name, view.shape, source.dtype, list(source.pieces),
                                     base_shape=source.shape, view=(view.offset, view.stride))  # fmt: skip
    return out


def _slice(source: SourceTensor, view: DiskTensor) -> SourceTensor:
    """``source`` cut to elements ``[view.offset, view.offset + numel)``, as pieces laid out in ``view.shape``."""
    first, last = view.offset, view.offset + math.prod(view.shape)
    pieces: list[Piece] = []
    for piece in source.pieces:
        span = flat_range(piece, source.shape) if piece.numel else None
        if span is None:
            continue
        lo, hi = max(first, span[0]), min(last, span[1])
        if lo >= hi:
            continue
        base = piece.select[0] if piece.select else 0
        for start, offsets, shape in flat_boxes(lo - first, hi - first, view.shape):
            a = lo + start - span[0]  # this box's first element, counted inside the piece
            n = math.prod(shape)
            if piece.raw:
                itemsize = source.dtype.itemsize
                pieces.append(replace(piece, offsets=offsets, shape=shape, start=piece.start + a * itemsize,
                                      length=n * itemsize))  # fmt: skip
            else:
                pieces.append(replace(piece, offsets=offsets, shape=shape, select=(base + a, base + a + n)))
    return SourceTensor(view.name, view.shape, source.dtype, pieces)


def flat_range(piece: Piece, full: tuple[int, ...]) -> tuple[int, int] | None:
    """``[first, end)`` element range of a piece in its full tensor, or None when it is not one run."""
    for d, size in enumerate(piece.shape):
        if size != 1:
            if any(piece.offsets[i] != 0 or piece.shape[i] != full[i] for i in range(d + 1, len(full))):
                return None
            break
    strides = c_strides(tuple(full))
    first = sum(o * s for o, s in zip(piece.offsets, strides))
    return first, first + piece.numel


def flat_boxes(first: int, end: int, shape: tuple[int, ...]) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """The element range ``[first, end)`` of a C-order tensor of ``shape`` as boxes ``(start, offsets, box_shape)``
    (``start`` relative to ``first``), each a run of consecutive elements (leading dimensions 1, trailing full)."""
    if first >= end:
        return []
    if not shape:
        return [(0, (), ())]
    inner = math.prod(shape[1:])
    row0, row1 = first // inner, end // inner
    boxes: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []
    if first % inner == 0 and row1 > row0:  # whole rows from the start
        boxes.append((0, (row0,) + (0,) * (len(shape) - 1), (row1 - row0, *shape[1:])))
        done = (row1 - row0) * inner
    else:  # a partial first row: recurse into it
        row_end = min(end, (row0 + 1) * inner)
        for start, offsets, box in flat_boxes(first - row0 * inner, row_end - row0 * inner, shape[1:]):
            boxes.append((start, (row0, *offsets), (1, *box)))
        done = row_end - first
    for start, offsets, box in flat_boxes(first + done, end, shape) if first + done < end else []:
        boxes.append((start + done, offsets, box))
    return boxes
