"""The coordinator's dedup and checks of a global save plan, linear in the rank count (see ``planning``)."""

from __future__ import annotations

import dataclasses
import math
from itertools import chain
from typing import Any

import numpy as np
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata
from torch.distributed.checkpoint.planner import SavePlan

from automodel_ckpt.distributed.dcp_private import validate_global_plan


def owners(ids_of: list[np.ndarray], id_count: int, weight: Any) -> list[np.ndarray]:
    """DCP's dedup on item ids (``ids_of[rank]``: an id below ``id_count`` per item, equal for equal keys;
    ``weight(rank, j)``: its tensor's bytes, or 1): each rank's mask of the items it writes.

    An item several ranks hold goes to the one with the least planned so far, in order of first appearance. A
    rank's load matters only where an item first appears at it, so only those ranks are walked, each up to its last
    such item; the holders (DCP's set, filled in the same order, so ties go where DCP's go) are found in numpy."""
    every = np.concatenate(ids_of) if ids_of else np.zeros(0, dtype=np.int64)
    counts = np.bincount(every, minlength=id_count)
    if counts.max(initial=0) <= 1:
        return [np.ones(len(ids), dtype=bool) for ids in ids_of]
    dup = counts > 1
    ranks = np.repeat(np.arange(len(ids_of)), list(map(len, ids_of)))
    held = dup[every]
    dup_ids, dup_ranks = every[held], ranks[held]
    order = np.argsort(dup_ids, kind="stable")  # by item, each item's holders in rank order
    dup_ids, dup_ranks = dup_ids[order], dup_ranks[order]
    cuts = np.flatnonzero(np.diff(dup_ids)) + 1
    starts = np.concatenate([[0], cuts]).tolist()
    listed = dup_ranks.tolist()
    holders = {i: set(listed[a:b]) for i, a, b in zip(dup_ids[starts].tolist(), starts, [*cuts.tolist(), len(listed)])}
    first = np.full(id_count, -1, dtype=np.int64)
    first[dup_ids[starts]] = dup_ranks[starts]  # the rank at which each duplicated item first appears
    load = [0] * len(ids_of)
    writer = np.full(id_count, -1, dtype=np.int64)
    out = []
    for rank, ids in enumerate(ids_of):
        shared = dup[ids]
        counted = 0
        for j in np.flatnonzero(shared & (first[ids] == rank)).tolist():  # the items that first appear here
            if writer[ids[j]] >= 0:  # held twice by this rank: given at its first
                continue
            for i in range(counted, j):  # this rank's own items up to this one
                if not shared[i]:
                    load[rank] += weight(rank, i)
            counted = j
            writer[ids[j]] = chosen = min(holders[int(ids[j])], key=load.__getitem__)
            load[chosen] += weight(rank, j)
        out.append(np.where(shared, writer[ids] == rank, True))
    return out


def validate(ranks: int, metadata: Metadata, bounds: dict[str, tuple[list, list]] | None = None) -> list[str]:
    """DCP's checks of a global plan (in bounds, no overlap, the tensor covered), linear where chunks form a grid."""
    errors: list[str] = []
    irregular: dict[str, Any] = {}
    for key, value in metadata.state_dict_metadata.items():
        if isinstance(value, BytesStorageMetadata) or len(value.size) == 0 or not value.chunks:
            continue
        size = np.asarray(value.size, dtype=np.int64)
        known = bounds.get(key) if bounds is not None else None
        offs, sizes = known or ([tuple(c.offsets) for c in value.chunks], [tuple(c.sizes) for c in value.chunks])
        shape = (len(value.chunks), len(size))
        if not isinstance(offs, np.ndarray):
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
        for message in validate_global_plan([SavePlan([])] * ranks, Metadata(_swept(irregular))):
            if "invalid fill" not in message:
                errors.append(message)
    return errors


def _is_grid(size: Any, offs: Any, ends: Any, sizes: Any) -> bool:
    """Whether the non-empty chunks are distinct cells of one grid (then no two overlap)."""
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
    """``irregular``'s tensors with the dimension of most distinct offsets made the longest, for DCP's sweep."""
    out = {}
    for key, value in irregular.items():
        best = max(range(len(value.size)), key=lambda d: len({c.offsets[d] for c in value.chunks}))
        size = [n + (sum(value.size) + 1 if d == best else 0) for d, n in enumerate(value.size)]
        out[key] = dataclasses.replace(value, size=size)
    return out
