"""A rank's write results as columns: one item list its peers share and an array of numbers, for the ``.metadata``.

The ranks that write the same kind of items differ only in numbers; results of another shape stay tuples."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from automodel_ckpt.ondisk.fastio.metapickle import Shape, Table
from automodel_ckpt.ondisk.saveplan.packed import int_bytes, ints, sharing, stacked

_NONE = -1


@dataclass(frozen=True)
class ResultColumns:
    """One rank's results. ``items``: ``(fqn, offset rank or -1, has an index, note's shape rank or -1, note's
    dtype name or None)``; ``numbers``: per item its offsets, index (if any), size in bytes, file (a place in
    ``files``), offset and length in it, then the note's data offset and tensor shape (if any)."""

    items: Any
    numbers: bytes
    files: tuple[str, ...]
    width: int = 8  # bytes an integer: 4 where every number fits int32


def split(tuples: list[tuple]) -> ResultColumns | None:
    """``plan_results.encode``'s tuples as ``ResultColumns``, or None where one does not fit them."""
    items, numbers, files = [], [], {}
    for fqn, offset, index, size, file, at, length, note in tuples:
        if type(fqn) is not str or type(file) is not str or not _ints(size, at, length) or \
                (offset is not None and (type(offset) is not tuple or not _ints(*offset))) or \
                (index is not None and type(index) is not int):
            return None
        if note is not None and (type(note) is not tuple or len(note) != 3 or type(note[1]) is not tuple or
                                 not _ints(note[0], *note[1]) or not isinstance(note[2], torch.dtype)):
            return None
        items.append((fqn, _NONE if offset is None else len(offset), index is not None,
                      _NONE if note is None else len(note[1]), None if note is None else _dtype_name(note[2])))
        if offset is not None:
            numbers += offset
        if index is not None:
            numbers.append(index)
        numbers += (size, files.setdefault(file, len(files)), at, length)
        if note is not None:
            numbers.append(note[0])
            numbers += note[1]
    if any(not -(1 << 63) <= n < (1 << 63) for n in numbers):
        return None
    data, width = int_bytes(numbers)
    return ResultColumns(items, data, tuple(files), width)


def joined(columns: ResultColumns) -> list[tuple]:
    """The tuples ``split`` made ``columns`` of."""
    numbers, at, out = ints(columns.numbers, columns.width).tolist(), 0, []
    for fqn, dims, has_index, note_dims, dtype in columns.items:
        offset = None
        if dims >= 0:
            offset, at = tuple(numbers[at:at + dims]), at + dims
        index = None
        if has_index:
            index, at = numbers[at], at + 1
        size, file, place, length = numbers[at:at + 4]
        at += 4
        note = None
        if note_dims >= 0:
            note = (numbers[at], tuple(numbers[at + 1:at + 1 + note_dims]), _dtype(dtype))
            at += 1 + note_dims
        out.append((fqn, offset, index, size, columns.files[file], place, length, note))
    return out


def _ints(*values: Any) -> bool:
    return all(type(v) is int for v in values)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    found = getattr(torch, name, None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"a write result names {name!r}, which is not a torch dtype")
    return found


@dataclass
class _Layout:
    """Where each field of one item list's results lies in a rank's numbers (``length``: the pad column, a zero)."""

    shapes: list[Shape]  # each item's record shape
    offsets: np.ndarray  # [items, width]
    index: np.ndarray
    file: np.ndarray
    at: np.ndarray
    length: np.ndarray
    note_at: np.ndarray
    note_shape: np.ndarray  # [items, note width]
    count: int  # numbers a rank sends


def _layout(items: list[tuple], width: int, note_width: int, shapes: dict[tuple, Shape]) -> _Layout:
    """``items``' layout, in numpy; ``shapes``: the record shapes made so far."""
    count = len(items)
    if not count:
        empty = np.zeros(0, dtype=np.int64)
        return _Layout([], np.zeros((0, width), np.int64), empty, empty, empty, empty, empty,
                       np.zeros((0, note_width), np.int64), 0)
    _, dims, has_index, note_dims, dtypes = zip(*items)
    dims_a = np.asarray(dims, dtype=np.int64)
    index_a = np.asarray(has_index, dtype=bool)
    note_a = np.asarray(note_dims, dtype=np.int64)
    lengths = np.maximum(dims_a, 0) + index_a + 4 + np.where(note_a >= 0, note_a + 1, 0)
    start = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    place = int(lengths.sum())  # the pad column
    after_offsets = start + np.maximum(dims_a, 0)
    size_at = after_offsets + index_a
    note_at = size_at + 4
    span = np.arange(max(width, note_width, 1))
    offsets = np.where(span[:width] < dims_a[:, None], start[:, None] + span[:width], place)
    note_shape = np.where(span[:note_width] < note_a[:, None], note_at[:, None] + 1 + span[:note_width], place)
    made = []
    for key in zip(dims, has_index, note_dims, dtypes):
        shape = shapes.get(key)
        if shape is None:
            shape = shapes[key] = Shape(key[0], not key[1], key[2], None if key[2] < 0 else _dtype(key[3]))
        made.append(shape)
    return _Layout(made, offsets, np.where(index_a, after_offsets, place), size_at + 1, size_at + 2, size_at + 3,
                   np.where(note_a >= 0, note_at, place), note_shape, place)


def _twice(items: list[tuple], layout: _Layout, numbers: np.ndarray) -> bool:
    """Whether a rank writes one key (``MetadataIndex``: name and offset) twice."""
    seen: dict[tuple, int] = {}
    name = [seen.setdefault((i[0], i[1]), len(seen)) for i in items]
    if len(seen) == len(items):
        return False
    counts = np.bincount(name)
    repeated = np.flatnonzero(counts[name] > 1)
    offsets = numbers[:, layout.offsets[repeated]]  # [ranks, repeated, width]
    ranks, n = offsets.shape[0], len(repeated)
    keys = np.concatenate([np.broadcast_to(np.arange(ranks)[:, None, None], (ranks, n, 1)),
                           np.broadcast_to(np.asarray(name)[repeated][None, :, None], (ranks, n, 1)), offsets], axis=2)
    return len(np.unique(keys.reshape(ranks * n, -1), axis=0)) != ranks * n


class StorageColumns:
    """Every rank's ``ResultColumns`` (items unpacked), in rank order: a storage table for ``metapickle``."""

    def __init__(self, ranks: list[ResultColumns]) -> None:
        self.ranks = ranks

    def __len__(self) -> int:
        return sum(len(r.items) for r in self.ranks)

    def table(self, memo: Any) -> Table | None:
        """The table's columns (strings in ``memo``'s slots); None where numbers and items differ or a key repeats."""
        groups = sharing([columns.items for columns in self.ranks])
        every = [i for ranks in groups for i in self.ranks[ranks[0]].items]
        width = max((i[1] for i in every), default=0)
        note_width = max((i[3] for i in every), default=0)
        fields = ("fqn", "path", "index", "at", "length", "note_at", "offsets", "note_shape", "shape")
        parts: list[dict[str, np.ndarray] | None] = [None] * len(self.ranks)
        kinds: dict[Shape, int] = {}
        made: dict[tuple, Shape] = {}
        for ranks in groups:
            items = self.ranks[ranks[0]].items
            layout = _layout(items, width, note_width, made)
            try:
                numbers = stacked([ints(self.ranks[r].numbers, self.ranks[r].width) for r in ranks], layout.count)
            except ValueError:  # numbers of another length than the items make
                return None
            if _twice(items, layout, numbers):
                return None
            fqn = np.array([memo.slot(i[0]) for i in items], dtype="<u4")
            shape = np.array([kinds.setdefault(s, len(kinds)) for s in layout.shapes], dtype=np.int64)
            files = numbers[:, layout.file]
            for k, rank in enumerate(ranks):
                names = self.ranks[rank].files
                if len(items) and (files[k].min() < 0 or files[k].max() >= len(names)):
                    return None
                slots = np.array([memo.slot(name) for name in names], dtype="<u4")
                parts[rank] = {"fqn": fqn, "path": slots[files[k]] if len(items) else fqn,
                               "index": numbers[k, layout.index], "at": numbers[k, layout.at],
                               "length": numbers[k, layout.length], "note_at": numbers[k, layout.note_at],
                               "offsets": numbers[k][layout.offsets], "note_shape": numbers[k][layout.note_shape],
                               "shape": shape}
        if not parts:
            return None
        column = {f: np.concatenate([p[f] for p in parts]) for f in fields}  # type: ignore[index]
        grouped = []
        for kind, code in kinds.items():
            rows = np.flatnonzero(column["shape"] == code)
            if not len(rows):
                continue
            starts = None if kind.dims < 0 else column["offsets"][rows, :kind.dims]
            shapes = None if kind.note_dims < 0 else column["note_shape"][rows, :kind.note_dims]
            grouped.append((kind, rows, starts, shapes))
        return Table(column["fqn"], column["path"], column["index"], column["at"], column["length"],
                     column["note_at"], grouped)
