"""A save's global plan made on columns: every rank's items as one shared list and an array of their numbers.

A layout's ranks hold the same items, only their numbers differ; other plans are DCP's (``plan_globally``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import WriteItemType

from automodel_ckpt.ondisk.saveplan.packed import int_bytes, ints, sharing, stacked
from automodel_ckpt.ondisk.saveplan.plan_checks import owners

_SHARD, _BYTE_IO = WriteItemType.SHARD.value, WriteItemType.BYTE_IO.value
_KEY_LIMIT = 1 << 62  # the dedup keys (one integer an item) stay below it, or DCP plans it


@dataclass(frozen=True)
class Columns:
    """A rank's encoded items: ``items`` ``(fqn, type, tensor size, properties #, bytes data)`` each, and
    ``numbers``, for each tensor item its offsets then its chunk's sizes (``packed.int_bytes``)."""

    items: Any
    numbers: bytes
    width: int = 8  # bytes an integer: 4 where every number fits int32


def split(entries: list[tuple]) -> Columns | None:
    """``entries`` as ``Columns``, or None where an item does not fit them."""
    items, numbers = [], []
    for fqn, kind, offset, c_off, c_size, size, prop, data in entries:
        if (size is None) != (kind == _BYTE_IO):
            return None
        if size is None:
            if offset is not None or c_off is not None or c_size is not None:
                return None
            items.append((fqn, kind, None, prop, data))
            continue
        if offset is None or c_off != offset or c_size is None or not len(offset) == len(c_size) == len(size):
            return None
        items.append((fqn, kind, size, prop, data))
        numbers += offset
        numbers += c_size
    return Columns(items, *int_bytes(numbers))


def joined(columns: Columns) -> list[tuple]:
    """The entries ``split`` made ``columns`` of."""
    numbers, at, out = ints(columns.numbers, columns.width).tolist(), 0, []
    for fqn, kind, size, prop, data in columns.items:
        if size is None:
            out.append((fqn, kind, None, None, None, None, None, data))
            continue
        d = len(size)
        offset = tuple(numbers[at:at + d])
        out.append((fqn, kind, offset, offset, tuple(numbers[at + d:at + 2 * d]), size, prop, data))
        at += 2 * d
    return out


@dataclass
class _Items:
    """One distinct item list's columns: what every rank that sent it shares."""

    items: list[tuple]
    fqn: np.ndarray  # each item's name, as an id
    tensor: np.ndarray  # a tensor item (else bytes)
    shard: np.ndarray  # a shard item
    sizes: np.ndarray  # [items, width] its tensor's size, 0 past its rank
    offsets_at: np.ndarray  # [items, width] where its offsets lie in a rank's numbers (``length``: 0 past its rank)
    sizes_at: np.ndarray  # the same for its chunk's sizes
    dims: np.ndarray  # its tensor's rank (0 for bytes)
    weight: list[int]  # what DCP's dedup counts for it: its tensor's bytes, or 1
    length: int  # how many numbers a rank sends
    radix: int  # the most offsets one of its tensors has (the product of its size + 1 along each dimension)


def _items(items: list[tuple], names: dict[str, int], properties: list[Any], width: int) -> _Items | None:
    count = len(items)
    sizes = np.zeros((count, width), dtype=np.int64)
    offsets_at = np.full((count, width), -1, dtype=np.int64)
    sizes_at = np.full((count, width), -1, dtype=np.int64)
    weight, at, radix = [1] * count, 0, 1
    for j, (_, _, size, prop, _) in enumerate(items):
        if size is None:
            continue
        d = len(size)
        sizes[j, :d] = size
        offsets_at[j, :d] = range(at, at + d)
        sizes_at[j, :d] = range(at + d, at + 2 * d)
        at += 2 * d
        radix = max(radix, math.prod(n + 1 for n in size))
        try:
            weight[j] = math.prod(size) * properties[prop].dtype.itemsize or 1
        except (IndexError, AttributeError, TypeError):
            return None
    offsets_at[offsets_at < 0] = at  # the pad column (a zero) that follows every rank's numbers
    sizes_at[sizes_at < 0] = at
    return _Items(items, np.fromiter((names.setdefault(i[0], len(names)) for i in items), dtype=np.int64, count=count),
                  np.fromiter((i[2] is not None for i in items), dtype=bool, count=count),
                  np.fromiter((i[1] == _SHARD for i in items), dtype=bool, count=count),
                  sizes, offsets_at, sizes_at, np.fromiter((0 if i[2] is None else len(i[2]) for i in items),
                                                           dtype=np.int64, count=count), weight, at, radix)


def plan(notes: list[Any]) -> tuple[list[np.ndarray], dict[str, Any], dict[str, tuple]] | None:
    """``plan_globally`` on ``Columns``: hints, metadata entries, each tensor's chunks; None where it does not fit."""
    names: dict[str, int] = {}
    distinct: dict[int, list[tuple]] = {id(n.entries.items): n.entries.items for n in notes}
    width = max((len(i[2]) for items in distinct.values() for i in items if i[2] is not None), default=0)
    made: dict[tuple, _Items] = {}  # per item list and the properties its numbers refer to (their dtypes)
    keys = [(id(n.entries.items), *(str(getattr(p, "dtype", p)) for p in n.properties)) for n in notes]
    for note, key in zip(notes, keys):
        if key not in made:
            found = _items(note.entries.items, names, note.properties, width)
            if found is None:
                return None
            made[key] = found
    per_rank = [made[key] for key in keys]
    if any(len(n.entries.numbers) != n.entries.width * s.length for n, s in zip(notes, per_rank)):
        return None
    radix = max((s.radix for s in made.values()), default=1)
    if (2 * len(names) + 2) * (width + 1) * radix >= _KEY_LIMIT:
        return None
    # the distinct items and numbers sent (replicas send the same): each source's rows once
    source_of: dict[tuple[int, int, bytes], int] = {}
    source = np.fromiter((source_of.setdefault((id(n.entries.items), n.entries.width, n.entries.numbers),
                                               len(source_of))
                          for n in notes), dtype=np.int64, count=len(notes))
    first_rank = np.unique(source, return_index=True)[1]  # each source's first rank (sources number in that order)
    sources = [per_rank[r] for r in first_rank.tolist()]
    offsets, sizes = _gathered(sources, [ints(notes[r].entries.numbers, notes[r].entries.width)
                                         for r in first_rank.tolist()])
    fqn, tensor, shard, extent, dims = (np.concatenate([getattr(s, f) for s in sources])
                                        for f in ("fqn", "tensor", "shard", "sizes", "dims"))
    if (offsets < 0).any() or (offsets > extent).any() or (sizes < 0).any():
        return None  # a chunk outside its tensor: DCP's way reports it
    # dedup: an item's key (name, kind, rank, offsets: DCP's ``MetadataIndex``) as one integer: its offsets in the
    # radix of its tensor's size + 1 (below ``radix``), below its name's, kind's and rank's place times ``radix``
    place = np.zeros(len(fqn), dtype=np.int64)
    for d in range(width):
        place = place * (extent[:, d] + 1) + offsets[:, d]
    ids = np.unique(((fqn * 2 + tensor) * (width + 1) + dims) * radix + place, return_inverse=True)[1].reshape(-1)
    base = np.cumsum([0, *(len(s.fqn) for s in sources)])
    of_source = [ids[a:b] for a, b in zip(base[:-1].tolist(), base[1:].tolist())]
    ids_of = [of_source[c] for c in source.tolist()]
    masks = owners(ids_of, int(ids.max(initial=-1)) + 1, lambda rank, j: per_rank[rank].weight[j])
    cuts = np.cumsum([0, *(len(s.fqn) for s in per_rank)])
    taken = np.flatnonzero(np.concatenate(masks)) if masks else np.zeros(0, dtype=np.int64)  # in the rank walk
    taken_rank = np.searchsorted(cuts, taken, side="right") - 1
    row = base[source[taken_rank]] + (taken - cuts[taken_rank])  # each taken item's row in its source
    # what DCP refuses: a name written twice unless as shards of one tensor, or as bytes and as a tensor
    taken_fqn, taken_tensor, taken_shard = fqn[row], tensor[row], shard[row]
    once = taken_fqn[~taken_shard]
    if len(np.unique(once)) != len(once) or np.isin(once, taken_fqn[taken_shard]).any() or \
            np.isin(taken_fqn[~taken_tensor], taken_fqn[taken_tensor]).any():
        return None
    # the hints: a chunk's place among its tensor's chunks, in the order the walk meets them
    hints = np.full(int(cuts[-1]), -2, dtype=np.int64)
    hints[taken[~taken_tensor]] = -1
    chunked = np.flatnonzero(taken_tensor)
    chunked = chunked[np.argsort(taken_fqn[chunked], kind="stable")]  # by tensor, each in walk order
    grouped = taken_fqn[chunked]
    starts = np.flatnonzero(np.concatenate(([True], grouped[1:] != grouped[:-1]))) if len(chunked) else \
        np.zeros(0, dtype=np.int64)
    ends = np.append(starts[1:], len(chunked)).astype(np.int64)
    hints[taken[chunked]] = np.arange(len(chunked)) - np.repeat(starts, ends - starts)
    span = dict(zip(grouped[starts].tolist(), zip(starts.tolist(), ends.tolist())))
    # the entries, each name where it is first written (as DCP adds them: a tensor's first chunk, a bytes item)
    by_id = list(names)
    md: dict[str, Any] = {}
    bounds: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    lists: dict[tuple, list] = {}
    for t in np.sort(np.concatenate([chunked[starts], np.flatnonzero(~taken_tensor)])).tolist():
        name, rank = by_id[int(taken_fqn[t])], int(taken_rank[t])
        if not taken_tensor[t]:
            md[name] = BytesStorageMetadata()
            continue
        _, _, size, prop, _ = per_rank[rank].items[int(taken[t] - cuts[rank])]
        a, b = span[int(taken_fqn[t])]
        rows = row[chunked[a:b]]
        offs, lens = offsets[rows, :len(size)], sizes[rows, :len(size)]
        bounds[name] = (offs, lens)
        md[name] = TensorStorageMetadata(properties=notes[rank].properties[prop], size=torch.Size(size),
                                         chunks=_chunks(lists, offs, lens))
    return [hints[a:b] for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist())], md, bounds


def _chunks(made: dict[tuple, list], offsets: np.ndarray, sizes: np.ndarray) -> list:
    """The chunk list at ``offsets`` of ``sizes``: the one made already for the same chunks (layers are cut alike)."""
    key = (offsets.shape, offsets.tobytes(), sizes.tobytes())
    found = made.get(key)
    if found is None:
        if len(sizes) and (sizes == sizes[0]).all():
            one = torch.Size(sizes[0].tolist())
            lengths: Any = [one] * len(sizes)
        else:
            lengths = list(map(torch.Size, sizes.tolist()))
        found = made[key] = list(map(ChunkStorageMetadata, map(torch.Size, offsets.tolist()), lengths))
    return found


def _gathered(per_rank: list[_Items], numbers: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Every rank's items' offsets and chunk sizes, ``[items, width]`` each (0 past a tensor's rank), rank by rank."""
    groups = sharing(per_rank)
    parts: list[Any] = [None] * len(per_rank)
    for ranks in groups:
        s = per_rank[ranks[0]]
        rows = stacked([numbers[r] for r in ranks], s.length)
        offsets, sizes = rows[:, s.offsets_at], rows[:, s.sizes_at]  # [ranks, items, width]
        if len(groups) == 1:
            shape = (offsets.shape[0] * offsets.shape[1], offsets.shape[2])  # -1 is ambiguous with no dimensions
            return offsets.reshape(shape), sizes.reshape(shape)
        for k, rank in enumerate(ranks):
            parts[rank] = (offsets[k], sizes[k])
    if not parts:
        return np.zeros((0, 0), dtype=np.int64), np.zeros((0, 0), dtype=np.int64)
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
