"""The coordinator's dedup and checks of a global save plan, linear in the rank count (see ``planning``)."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from itertools import chain, compress
from operator import itemgetter
from typing import Any

import numpy as np
from torch.distributed.checkpoint.default_planner import _validate_global_plan
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata
from torch.distributed.checkpoint.planner import SavePlan


def dedup(notes: list[Any]) -> list[list[bool]]:
    """Which rank writes each item (``dedup_save_plans``, the same choices): ``[rank][item]`` True where it does.

    An item several ranks hold goes to the one with the least planned so far (DCP counts a tensor item as its
    whole tensor's bytes, anything else as 1), walking the items in the order they first appear: rank by rank.
    A rank's load is read only when an item it holds first appears, at that rank: then it holds what was given
    to it before and its own items before that one, and no rank before it holds the item. So a rank's own sizes
    are summed only up to the last item that first appears at it, and the rest is done in C (``map``,
    ``compress``) but for the duplicates."""
    keys_of = [list(map(_KEY, note.entries)) for note in notes]
    counts = Counter(chain.from_iterable(keys_of))
    if len(counts) == sum(map(len, keys_of)):
        return [[True] * len(keys) for keys in keys_of]
    dups = set(compress(counts, map((1).__lt__, counts.values())))
    del counts
    places = []  # per rank: the positions of its duplicated items
    holders: dict[tuple, set[int]] = {}
    for rank, keys in enumerate(keys_of):
        at = list(compress(range(len(keys)), map(dups.__contains__, keys)))
        places.append(at)
        for j in at:
            found = holders.get(keys[j])
            if found is None:
                found = holders[keys[j]] = set()
            found.add(rank)
    load = [0] * len(notes)
    writer: dict[tuple, int] = {}
    out = []
    for rank, (note, keys, at) in enumerate(zip(notes, keys_of, places)):
        counted, dup_at = 0, set(at)
        for j in at:
            key = keys[j]
            if key in writer:
                continue
            for i in range(counted, j):  # this rank's own items up to this one
                if i not in dup_at:
                    load[rank] += _storage(note, note.entries[i])
            counted = j
            writer[key] = chosen = min(holders[key], key=load.__getitem__)
            load[chosen] += _storage(note, note.entries[j])
        mine = [True] * len(keys)
        for j in at:
            mine[j] = writer[keys[j]] == rank
        out.append(mine)
    return out


def _storage(note: Any, entry: tuple) -> int:
    """What DCP's dedup counts for an item: its whole tensor's bytes, or 1."""
    size = entry[5]
    return (math.prod(size) * note.properties[entry[6]].dtype.itemsize if size is not None else 0) or 1


_KEY = itemgetter(0, 2)  # an encoded item's (fqn, offset): DCP's MetadataIndex as a dedup key


def validate(ranks: int, metadata: Metadata, bounds: dict[str, tuple[list, list]] | None = None) -> list[str]:
    """DCP's checks of a global plan (every chunk within bounds, no two overlapping, all of them covering the
    tensor when more than one rank saves), without comparing chunks pairwise where they form a grid. ``bounds``:
    each tensor's chunk offsets and sizes as tuples (else read from the metadata's chunks)."""
    errors: list[str] = []
    irregular: dict[str, Any] = {}
    for key, value in metadata.state_dict_metadata.items():
        if isinstance(value, BytesStorageMetadata) or len(value.size) == 0 or not value.chunks:
            continue
        size = np.asarray(value.size, dtype=np.int64)
        known = bounds.get(key) if bounds is not None else None
        offs, sizes = known or ([tuple(c.offsets) for c in value.chunks], [tuple(c.sizes) for c in value.chunks])
        shape = (len(value.chunks), len(size))
        offs = np.fromiter(chain.from_iterable(offs), dtype=np.int64, count=shape[0] * shape[1]).reshape(shape)
        sizes = np.fromiter(chain.from_iterable(sizes), dtype=np.int64, count=shape[0] * shape[1]).reshape(shape)
        ends = offs + sizes
        for i in np.flatnonzero((offs < 0).any(1) | (sizes < 0).any(1) | (ends > size).any(1)):
            errors.append(f"key:{key} has out of bounds chunk: tensor-size:{value.size} chunk: {value.chunks[i]}")
        if len(value.chunks) > 1 and not _is_grid(size, offs, ends, sizes):
            irregular[key] = value
        volumes = np.prod(sizes, axis=1)
        volume = int(volumes.sum()) if float(np.abs(volumes.astype(np.float64)).sum()) < 2.0 ** 62 else \
            sum(int(v) for v in volumes)
        if ranks > 1 and volume != math.prod(value.size):
            errors.append(f"key:{key} invalid fill tensor-volume: {math.prod(value.size)} chunks-volume: {volume}")
    if irregular:  # DCP's sweep, on the dimension with the most distinct offsets; its coverage check is above
        for message in _validate_global_plan([SavePlan([])] * ranks, Metadata(_swept(irregular))):
            if "invalid fill" not in message:
                errors.append(message)
    return errors


def _is_grid(size: Any, offs: Any, ends: Any, sizes: Any) -> bool:
    """Whether the non-empty chunks are distinct cells of one grid: along each dimension their distinct
    intervals, sorted, follow one another from 0 to the end (a partition), and no two chunks start at the same
    offsets. Then no two overlap. Sorting in numpy (1-D keys); no pair of chunks compared."""
    full = (sizes > 0).all(axis=1)
    offs, ends = offs[full], ends[full]
    if len(offs) < 2:
        return True
    starts = None  # each chunk's offsets as one number (mixed radix), where they fit
    for d in range(offs.shape[1]):
        o, e = offs[:, d], ends[:, d]
        if o.min() == o.max() and e.min() == e.max():  # one interval (a dimension not cut)
            if o[0] != 0 or e[0] != size[d]:
                return False
            continue
        if o.min() < 0 or e.max() > size[d]:
            return False
        order = np.lexsort((e, o))  # by start, then end
        o, e = o[order], e[order]
        distinct = np.concatenate(([True], (o[1:] != o[:-1]) | (e[1:] != e[:-1])))
        o, e = o[distinct], e[distinct]
        if o[0] != 0 or e[-1] != size[d] or not np.array_equal(o[1:], e[:-1]):
            return False
        if starts is None:
            starts = offs[:, d].copy()
        elif float(starts.max()) * (float(size[d]) + 1) < 2.0 ** 62:
            starts = starts * (int(size[d]) + 1) + offs[:, d]
        else:
            return len(np.unique(offs, axis=0)) == len(offs)
    if starts is None:  # every chunk the whole tensor
        return False
    starts.sort()
    return not (starts[1:] == starts[:-1]).any()


def _swept(irregular: dict[str, Any]) -> dict[str, Any]:
    """``irregular``'s tensors with the dimension of most distinct offsets made the longest, so that DCP's sweep
    (along the longest) runs along it and the chunks rarely stay active together."""
    out = {}
    for key, value in irregular.items():
        best = max(range(len(value.size)), key=lambda d: len({c.offsets[d] for c in value.chunks}))
        size = [n + (sum(value.size) + 1 if d == best else 0) for d, n in enumerate(value.size)]
        out[key] = dataclasses.replace(value, size=size)
    return out
