"""LocalLoadPlanner's read items: DCP's own, item for item and in the same order, for FSDP, HSDP and TP-FSDP
layouts, resharding loads, shuffled metadata and irregular chunks."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from automodel_ckpt.ondisk.saveplan import planning

_SPEC = importlib.util.spec_from_file_location("scale_sim", Path(__file__).parents[4] / "tools" / "scale_sim.py")
sim = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(sim)

# uneven rows, fewer rows than ranks (empty chunks), a long second dimension (DCP sweeps along it), a vector
_SHAPES = [("a.q_proj.weight", (24, 40)), ("a.k_proj.weight", (5, 72)), ("a.down_proj.weight", (18, 90)),
           ("a.o_proj.weight", (40, 16)), ("a.norm.weight", (13,))]


def _chunk(offsets, sizes) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))


def _saved(strategy: str, n: int, fqn: str, shape: tuple[int, ...], shuffle: int | None = None) -> TensorStorageMetadata:
    """A tensor's metadata as a save at ``n`` ranks writes it: each distinct chunk once (replicas deduplicated)."""
    seen, chunks = set(), []
    for sizes, offsets in sim._chunks(strategy, sim._kind(fqn), shape, n):
        if offsets not in seen:
            seen.add(offsets)
            chunks.append(_chunk(offsets, sizes))
    if shuffle is not None:
        random.Random(shuffle).shuffle(chunks)
    props = TensorProperties(dtype=torch.float32)
    return TensorStorageMetadata(properties=props, size=torch.Size(shape), chunks=chunks)


def _same(fqn, md, local):
    ours, dcps = planning.read_items_for_chunks(fqn, md, local), create_read_items_for_chunk_list(fqn, md, local)
    assert ours == dcps
    assert repr(ours) == repr(dcps)  # torch.Size, not tuples
    return len(ours)


@pytest.mark.parametrize("strategy,saved_n,loaded_n", [
    ("fsdp", 8, 8), ("hsdp", 16, 16), ("tp-fsdp", 16, 16),  # the same world size
    ("fsdp", 2, 1), ("fsdp", 4, 3), ("fsdp", 7, 12),  # resharding, under FSDP
    ("hsdp", 16, 8), ("tp-fsdp", 16, 8)])  # and from a 2-D mesh onto another
def test_read_items_are_dcps(strategy, saved_n, loaded_n):
    load_strategy = strategy if loaded_n % sim.TP == 0 else "fsdp"
    items = 0
    for shuffle in (None, 1):
        for fqn, shape in _SHAPES:
            md = _saved(strategy, saved_n, fqn, shape, shuffle)
            pieces = [_chunk(o, s) for s, o in sim._chunks(load_strategy, sim._kind(fqn), shape, loaded_n)]
            for piece in pieces:
                items += _same(fqn, md, [piece])
            items += _same(fqn, md, pieces[::-1])  # several local chunks (as a ShardedTensor has), out of order
    assert items > 0


def test_irregular_chunks_and_scalars_give_dcps_read_items():
    rng = random.Random(0)
    for _ in range(200):  # overlapping, empty and out-of-grid boxes: no layout assumed
        dims = rng.randint(1, 3)
        boxes = [[_chunk([rng.randint(0, 9) for _ in range(dims)], [rng.randint(0, 5) for _ in range(dims)])
                  for _ in range(rng.randint(1, 6))] for _ in range(2)]
        md = TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32), size=torch.Size([15] * dims),
                                   chunks=boxes[0])
        _same("t", md, boxes[1])
    scalar = TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32), size=torch.Size([]),
                                   chunks=[_chunk([], []), _chunk([], [])])
    assert _same("s", scalar, [_chunk([], [])]) == 2
    assert planning.read_items_for_chunks("t", md, []) == []


def test_local_load_plan_is_dcps_and_fails_as_it_does():
    state = {"w": torch.zeros(6, 10), "b": torch.zeros(3), "s": torch.tensor(1.0), "step": 5}
    props = TensorProperties(dtype=torch.float32)
    md = Metadata({
        "w": TensorStorageMetadata(props, torch.Size([6, 10]), [_chunk([r * 2, 0], [2, 10]) for r in range(3)]),
        "b": TensorStorageMetadata(props, torch.Size([3]), [_chunk([2], [1]), _chunk([0], [2])]),
        "s": TensorStorageMetadata(props, torch.Size([]), [_chunk([], [])]),
        "step": BytesStorageMetadata()})
    ours, dcps = planning.local_load_plan(state, md), create_default_local_load_plan(state, md)
    assert ours.items == dcps.items and repr(ours.items) == repr(dcps.items) and len(ours.items) == 7
    with pytest.raises(RuntimeError, match="Missing key in checkpoint state_dict: extra"):
        planning.local_load_plan({**state, "extra": torch.zeros(1)}, md)
    assert planning.local_load_plan({**state, "extra": torch.zeros(1)}, md, strict=False).items == ours.items
    with pytest.raises(ValueError, match="Size mismatch"):
        planning.local_load_plan({**state, "b": torch.zeros(4)}, md)
