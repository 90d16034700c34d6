"""Save and load planning linear in the rank count, save plans cached across saves of one layout.

``LinearSavePlanner`` is DCP's ``DefaultSavePlanner`` with two changes, both on the coordinator's side:

* **Linear validation.** DCP checks that no two chunks of a tensor overlap with a sweep along the tensor's longest
  dimension; when the shards are cut along another one (FSDP's dim 0 of ``down_proj``, ``k_proj``: 8,192 x 28,672
  and 1,024 x 8,192 in Llama-3-70B) every chunk is active at once and the sweep compares every pair: quadratic in
  the rank count (36.8 s of planning at 1,024 ranks, 722 tensors). Here a tensor's chunks pass when, along every
  dimension, their distinct intervals tile the dimension exactly and no two chunks start at the same offsets: each
  chunk is then one cell of a grid, so none overlaps another; with the volume check (kept from DCP), every cell is
  present. Every layout FSDP, HSDP and TP produce is such a grid; anything else falls back to the sweep, on the
  dimension with the most distinct offsets. Chunks without elements (the shards past the end of a dimension that
  has fewer rows than ranks) only need to lie within bounds. The checks and DCP's dedup: ``plan_checks``.
* **A cache across saves.** Each rank fingerprints its local plan (the items, their offsets, sizes and dtypes, the
  state's key mapping). When it equals the one of this rank's last save under the same ``key`` (a state folder
  of the checkpoint, e.g. ``model``), the rank sends the coordinator a plan with no items and the fingerprint; when
  every rank does, and the coordinator holds the same fingerprints for every rank, the cached global plan and
  metadata are reused and every rank gets an empty plan back (then writes its cached final plan). Anything else
  (another world size, strategy, parameter set, shape or dtype) is planned afresh and replaces the cache. An entry
  is taken out of the cache when a save starts and put back only when its plan is final, so a save that fails
  leaves nothing stale; the coordinator refuses (on every rank) a fingerprint it does not hold.

Loads: ``LocalLoadPlanner`` keeps each rank's load plan to itself and finds its read items with
``read_items_for_chunks`` (DCP's own, found in one pass over a tensor's saved chunks, not DCP's quadratic sweep).

Torch's own ``enable_plan_caching`` keys its class-level cache by the planner's class name, so a model save and
an optimizer save evict each other's entries at every checkpoint; its validation is the sweep above.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import pickle
from contextlib import contextmanager, nullcontext
from itertools import chain
from operator import attrgetter
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.default_planner import (
    DefaultSavePlanner,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor

from automodel_ckpt.distributed.dcp_private import (create_chunk_list, create_read_item_for_tensor, create_read_items,
                                                 flatten_state_dict, saved_before_2_4, shards_overlap_region)
from automodel_ckpt.ondisk.saveplan import plan_columns
from automodel_ckpt.ondisk.saveplan.packed import Packed, Unpacker, items_packed, pack
from automodel_ckpt.ondisk.saveplan.plan_checks import dedup, validate
from automodel_ckpt.ondisk.saveplan.plan_columns import Columns, joined, split
from automodel_ckpt.ondisk.formats.safe_load import SafeLoadPlanner


@dataclass(frozen=True)
class PlanNote:
    """What a rank sends the coordinator in place of its local plan's items: the plan's fingerprint, and unless
    the plan is unchanged, its items and the state's key mapping (DCP's ``planner_data``), both ``Packed``: the
    items as ``plan_columns.Columns`` (an item list its peers share, and its numbers) where they fit, else as plain
    tuples (``_encode``). Unpickling DCP's ``WriteItem`` objects costs the coordinator ~30 us an item (722 items a
    rank for Llama-3-70B); tuples of strings and ints a fraction of that, columns almost nothing."""

    fingerprint: str
    entries: "list[tuple] | Packed | Columns | None" = None
    properties: list[Any] | None = None
    mappings: Any = None


def _unpacked(notes: list[PlanNote]) -> list[PlanNote]:
    """``notes`` with their packed parts unpickled, each distinct one once."""
    value = Unpacker()

    def entries(part: Any) -> Any:
        return value.items(part) if isinstance(part, Columns) else value(part)

    return [note if not isinstance(note.entries, (Packed, Columns)) and not isinstance(note.mappings, Packed) else
            dataclasses.replace(note, entries=entries(note.entries), mappings=value(note.mappings)) for note in notes]


@dataclass(frozen=True)
class PlanReply:
    """What the coordinator sends each rank back: for each of its local items, its index hint in the metadata
    (``-1``: kept as it is, a plain value; ``-2``: another rank writes it), as int64 bytes."""

    hints: bytes


@dataclass
class _RankEntry:
    fingerprint: str
    final_plan: SavePlan


@dataclass
class _CoordinatorEntry:
    notes: list[PlanNote]
    metadata: Metadata


#: per process: (key, world size, rank) -> this rank's last final plan; (key, world size) -> the coordinator's
_RANK_CACHE: dict[tuple[str, int, int], _RankEntry] = {}
_COORDINATOR_CACHE: dict[tuple[str, int], _CoordinatorEntry] = {}


def clear_cache() -> None:
    """Forget every cached plan of this process."""
    _RANK_CACHE.clear()
    _COORDINATOR_CACHE.clear()


def _encode(plan: SavePlan) -> tuple[list[tuple], list[Any]]:
    """``plan``'s items as ``(fqn, type, offset, chunk offsets, chunk sizes, size, properties #, bytes data)``,
    the distinct ``TensorProperties`` apart."""
    table: dict[Any, int] = {}
    props: list[Any] = []
    entries = []
    for wi in plan.items:
        offset = tuple(wi.index.offset) if wi.index.offset is not None else None
        td = wi.tensor_data
        if td is None:
            entries.append((wi.index.fqn, wi.type.value, offset, None, None, None, None, _plain(wi.bytes_io_data)))
            continue
        p = td.properties
        key = (p.dtype, p.layout, p.requires_grad, p.memory_format, p.pin_memory)
        if key not in table:
            table[key] = len(props)
            props.append(p)
        chunk = td.chunk
        c_off = None if chunk is None else tuple(chunk.offsets)
        entries.append((wi.index.fqn, wi.type.value, offset, offset if c_off == offset else c_off,  # one object
                        None if chunk is None else tuple(chunk.sizes), tuple(td.size), table[key],
                        _plain(wi.bytes_io_data)))
    return entries, props


def _plain(data: Any) -> Any:
    """A write item's ``bytes_io_data`` (DCP's ``BytesIOWriteData``, or None) as plain values: its fields, sorted."""
    return None if data is None else tuple(sorted(vars(data).items()))


def fingerprint(entries: list[tuple], properties: list[Any], mappings: Any) -> str:
    """A digest of what decides the global plan and the metadata: every item (kind, key, offsets, sizes, the
    tensor's size and properties) and the state's key mapping."""
    props = [(str(p.dtype), str(p.layout), p.requires_grad, str(p.memory_format), p.pin_memory) for p in properties]
    return hashlib.blake2b(pickle.dumps((entries, props, mappings), protocol=4), digest_size=16).hexdigest()


class LinearSavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` with linear validation, compact plans on the wire and a global plan cached per
    ``key`` (see the module's docstring). ``key``: the state being saved (one per state folder); None plans every
    save afresh. ``world_size`` and ``rank``: this rank's place in the group the save runs on. The final plan of
    every rank and the metadata are those ``DefaultSavePlanner`` makes."""

    def __init__(self, key: str | None = None, *, world_size: int = 1, rank: int = 0) -> None:
        super().__init__()
        self.key, self.world_size, self.rank = key, world_size, rank
        self.reused = False  # whether this save's plan came from the cache
        self._fingerprint: str | None = None
        self._local: SavePlan | None = None
        self._cached: _RankEntry | None = None

    # ----------------------------------------------------------------------------------------- every rank
    def create_local_plan(self) -> SavePlan:
        return self.outgoing(create_default_local_save_plan(self.state_dict, self.is_coordinator))

    def outgoing(self, plan: SavePlan) -> SavePlan:
        """What this rank sends the coordinator for its local ``plan``: a ``PlanNote`` of its items, or of its
        fingerprint alone when the plan is this rank's last one under ``key``."""
        mappings = self.mappings if self.flatten_state_dict else None
        self._local = SavePlan(plan.items, planner_data=mappings)
        entries, props = _encode(plan)
        self._fingerprint = fingerprint(entries, props, mappings)
        if self.key is not None:
            cached = _RANK_CACHE.pop((self.key, self.world_size, self.rank), None)  # back once this plan is final
            if cached is not None and cached.fingerprint == self._fingerprint:
                self._cached = cached
                self.plan = SavePlan([], planner_data=PlanNote(self._fingerprint), usable=False)
                return self.plan
        columns = split(entries)
        sent = pack(entries) if columns is None else items_packed(columns)
        self.plan = SavePlan([], planner_data=PlanNote(self._fingerprint, sent, props, pack(mappings)))
        return self.plan

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        if not new_plan.usable:  # the coordinator reused its cached plans: so does this rank
            if self._cached is None:
                raise ValueError("the coordinator reused a cached save plan that this rank does not hold")
            final = self._cached.final_plan
            self.reused = True
        else:
            assert self._local is not None and isinstance(new_plan.planner_data, PlanReply)
            final = SavePlan(_apply(self._local.items, new_plan.planner_data.hints), storage_data=new_plan.storage_data,
                             planner_data=self._local.planner_data)
        if self.key is not None and self._fingerprint is not None:
            _RANK_CACHE[(self.key, self.world_size, self.rank)] = _RankEntry(self._fingerprint, final)
        self.plan = final
        return final

    # ----------------------------------------------------------------------------------------- the coordinator
    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        sent = [p.planner_data if isinstance(p.planner_data, PlanNote) else None for p in all_plans]
        if any(note is None for note in sent):
            raise ValueError("a rank sent a save plan without a PlanNote: every rank plans with LinearSavePlanner")
        notes: list[PlanNote] = sent  # type: ignore[assignment]
        cache_key = (self.key, len(all_plans)) if self.key is not None else None
        entry = _COORDINATOR_CACHE.pop(cache_key, None) if cache_key is not None else None
        if entry is not None and all(n.entries is None for n in notes) and \
                [n.fingerprint for n in entry.notes] == [n.fingerprint for n in notes]:
            metadata, self.reused = entry.metadata, True
            replies = [SavePlan([], usable=False) for _ in notes]
        else:
            full = []
            for rank, note in enumerate(_unpacked(notes)):
                if note.entries is None:  # unchanged: the coordinator holds it, or the save cannot go on
                    if entry is None or entry.notes[rank].fingerprint != note.fingerprint:
                        raise ValueError(f"rank {rank} sent an unchanged save plan that the coordinator does not hold")
                    note = entry.notes[rank]
                full.append(note)
            with gc_paused():
                hints, metadata = plan_globally(full, self.flatten_state_dict)
                entry = _CoordinatorEntry(full, metadata)
                replies = [SavePlan([], planner_data=PlanReply(h.tobytes())) for h in hints]
        if cache_key is not None:
            _COORDINATOR_CACHE[cache_key] = entry
        self.metadata = dataclasses.replace(metadata)  # the storage writer sets storage_data on its own copy
        return replies, self.metadata


#: new tracked objects past which ``gc_paused`` moves them to the oldest generation without a collection
MANY_OBJECTS = 100_000
#: ranks from which a save's coordinator runs the whole save in ``gc_paused`` (``sharded``): it then unpickles
#: every rank's plan and write results, half a million tuples at 256 ranks of a 70B model's optimizer state
GC_PAUSED_FROM = 256


def coordinating(world_size: int, rank: int) -> Any:
    """What a save runs in on ``rank`` of ``world_size``: ``gc_paused`` on the coordinator of a large save (it
    unpickles every rank's plan and write results as they are gathered), else nothing."""
    return gc_paused() if rank == 0 and world_size >= GC_PAUSED_FROM else nullcontext()


@contextmanager
def gc_paused():
    """No cyclic garbage collection while millions of objects that form no cycles are made (chunks, indices): each
    collection walks every object made since the last one, and a full one every object held, which made planning
    superlinear (at 1,024 ranks, 3.3 of the coordinator's 6.2 s were collections right after the plan).

    On the way out, when more than ``MANY_OBJECTS`` were made, they are moved as they are into the oldest
    generation (``gc.freeze`` then ``gc.unfreeze``, two list splices): no young collection walks them, nor are
    they counted towards a full one; the global plan and metadata are long-lived anyway (cached until the layout
    changes). Objects the process froze before are unfrozen with them, into the same generation (telling them
    apart would take ``gc.get_freeze_count``, which walks every frozen object)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if gc.get_count()[0] > MANY_OBJECTS:
            gc.freeze()
            gc.unfreeze()
        if was:
            gc.enable()


def _apply(items: list[WriteItem], hints: bytes) -> list[WriteItem]:
    """A rank's global plan from its local items and the coordinator's hints (as DCP's global plan has them)."""
    return [item if hint == -1 else dataclasses.replace(item, index=dataclasses.replace(item.index, index=hint))
            for item, hint in zip(items, np.frombuffer(hints, dtype=np.int64).tolist(), strict=True) if hint != -2]


def plan_globally(notes: list[PlanNote], flatten: bool = True) -> tuple[list[np.ndarray], Metadata]:
    """DCP's dedup (``dedup_save_plans``: an item several ranks hold goes to the one with the least planned so
    far), global plan (``create_default_global_save_plan``: index hints, the metadata) and merged mappings, on
    the ranks' encoded plans; validated linearly. Raises ``ValueError`` as DCP does for an invalid plan. Each
    rank's hints: int64, -1 kept as it is, -2 written by another rank. Ranks that all sent ``Columns`` are
    planned on them (``plan_columns``) where they fit."""
    columns = all(isinstance(n.entries, Columns) for n in notes)
    found = plan_columns.plan(notes) if columns and notes else None
    if found is not None:
        hints_of, md, bounds = found
        return hints_of, _finished(notes, md, bounds, flatten)
    if columns or any(isinstance(n.entries, Columns) for n in notes):  # given back as tuples
        notes = [dataclasses.replace(n, entries=joined(n.entries)) if isinstance(n.entries, Columns) else n
                 for n in notes]
    owners = dedup(notes)
    md: dict[str, Any] = {}
    bounds: dict[str, tuple[list, list]] = {}  # fqn -> its chunks' offsets and sizes, as plain tuples
    hints_of = []
    for rank, note in enumerate(notes):
        hints: list[int | None] = []
        for (fqn, kind, offset, c_off, c_size, size, prop, _), owner in zip(note.entries, owners[rank]):
            if not owner:
                hints.append(None)
                continue
            if kind != _SHARD and fqn in md:
                raise AssertionError("item.index.fqn not in md")
            if kind == _BYTE_IO:
                md[fqn] = BytesStorageMetadata()
                hints.append(-1)
                continue
            if size is None:
                raise AssertionError("item.tensor_data is not None")
            found = bounds.get(fqn)
            if found is None:
                if fqn in md:  # as DCP: a tensor chunk of a name saved as bytes
                    raise AttributeError("'BytesStorageMetadata' object has no attribute 'chunks'")
                md[fqn] = TensorStorageMetadata(properties=note.properties[prop], size=torch.Size(size), chunks=[])
                found = bounds[fqn] = ([], [])
            if c_off is None:
                raise AssertionError(f"Cannot create MD for tensor without bounds. FQN: {fqn}")
            hints.append(len(found[0]))
            found[0].append(c_off)
            found[1].append(c_size)
        hints_of.append(np.array([-2 if h is None else h for h in hints], dtype=np.int64))
    shared: dict[tuple, torch.Size] = {}  # most chunks share their sizes: one torch.Size each
    for fqn, (offs, sizes) in bounds.items():  # a tensor's chunks made together: near one another in memory
        for c_size in set(sizes) - shared.keys():
            shared[c_size] = torch.Size(c_size)
        md[fqn].chunks = [ChunkStorageMetadata(torch.Size(c_off), shared[c_size]) for c_off, c_size in zip(offs, sizes)]
    return hints_of, _finished(notes, md, bounds, flatten)


def _finished(notes: list[PlanNote], md: dict[str, Any], bounds: dict[str, tuple], flatten: bool) -> Metadata:
    """The metadata of entries ``md`` with the ranks' merged key mappings, validated."""
    metadata = Metadata(md)
    if flatten:
        metadata = dataclasses.replace(metadata, planner_data=merged_mappings([n.mappings for n in notes]))
    errors = validate(len(notes), metadata, bounds)
    if errors:
        summary = "; ".join(errors)
        raise ValueError(f"Failed to validate global plan: {summary[:500]}{'... (truncated)' if len(summary) > 500 else ''}")
    return metadata


def merged_mappings(mappings: list[dict]) -> dict:
    """``dict(ChainMap(*mappings))`` (DCP's merge of the ranks' key mappings: a key's value from the first rank
    that has it, keys in the order ``ChainMap`` lists them) by one ``update`` per rank, last rank first: ``ChainMap``
    looks every key up through the ranks in turn (1 s at 1,024 ranks of an optimizer's 2,178 keys)."""
    merged: dict = {}
    done: set[int] = set()
    for mapping in reversed(mappings):
        if id(mapping) not in done:  # the same mapping again (``Packed``: one object for every rank that sent it)
            done.add(id(mapping))
            merged.update(mapping)
    return merged


_SHARD, _BYTE_IO = WriteItemType.SHARD.value, WriteItemType.BYTE_IO.value


_OFFSETS, _SIZES = attrgetter("offsets"), attrgetter("sizes")


_FEW_CHUNKS = 16  # a tensor saved in at most this many chunks is searched by DCP itself (tens of microseconds less)


def read_items_for_chunks(fqn: str, md: TensorStorageMetadata, local_chunks: list[ChunkStorageMetadata]) -> list:
    """DCP's ``create_read_items_for_chunk_list``, the same ``ReadItem`` objects in the same order, with the
    saved chunks overlapping each local chunk found in numpy. DCP sweeps along the tensor's longest dimension;
    when the chunks are cut along another one (FSDP's dim 0 of ``k_proj``, ``down_proj``) every saved chunk stays
    active and is inserted into a sorted list: quadratic in the rank count. Here each local chunk is compared with
    every saved chunk at once (linear), and its overlaps ordered as DCP's active list holds them: by their end
    along the sweep dimension, then by index. Chunks of differing ranks, and tensors of few chunks, go to DCP's
    own search."""
    saved = md.chunks
    if not local_chunks or not saved:
        return []
    if len(saved) <= _FEW_CHUNKS:  # DCP's sweep is quick for few chunks, and numpy's fixed cost is not
        return create_read_items_for_chunk_list(fqn, md, local_chunks)
    dims = len(local_chunks[0].offsets)
    saved_offs, saved_sizes = list(map(_OFFSETS, saved)), list(map(_SIZES, saved))  # one pass each, in C
    if {*map(len, saved_offs), *map(len, saved_sizes)} != {dims} or \
            any(len(c.offsets) != dims or len(c.sizes) != dims for c in local_chunks):
        return create_read_items_for_chunk_list(fqn, md, local_chunks)
    n = len(saved)
    offs = np.fromiter(chain.from_iterable(saved_offs), dtype=np.int64, count=n * dims).reshape(n, dims)
    ends = offs + np.fromiter(chain.from_iterable(saved_sizes), dtype=np.int64, count=n * dims).reshape(n, dims)
    l_offs = np.asarray([tuple(c.offsets) for c in local_chunks], dtype=np.int64).reshape(len(local_chunks), dims)
    l_ends = l_offs + np.asarray([tuple(c.sizes) for c in local_chunks], dtype=np.int64).reshape(l_offs.shape)
    sweep = int(np.argmax(np.maximum(ends.max(axis=0), l_ends.max(axis=0)))) if dims > 1 else 0
    items = []
    for local_idx in (np.argsort(l_offs[:, sweep], kind="stable") if dims else range(len(local_chunks))):
        local_idx = int(local_idx)
        local = local_chunks[local_idx]
        if dims:
            found = np.flatnonzero((offs < l_ends[local_idx]).all(axis=1) & (ends > l_offs[local_idx]).all(axis=1))
            found = found[np.argsort(ends[found, sweep], kind="stable")]
        else:
            found = range(n)
        dest = MetadataIndex(fqn, local.offsets, local_idx)
        for storage_idx in found:
            storage_idx = int(storage_idx)
            chunk = saved[storage_idx]
            narrows = shards_overlap_region(saved_shard=chunk, current_shard=local)
            items.append(create_read_item_for_tensor(
                dest_index=dest, dest_offsets=[r[2] for r in narrows],
                storage_index=MetadataIndex(fqn, chunk.offsets, storage_idx),
                storage_offsets=[r[1] for r in narrows], lengths=[r[3] for r in narrows]))
    return items


def local_load_plan(state_dict: dict[str, Any], metadata: Metadata, strict: bool = True) -> LoadPlan:
    """DCP's ``create_default_local_load_plan`` with its tensors' read items from ``read_items_for_chunks``."""
    requests = []
    for fqn, obj in state_dict.items():
        md = metadata.state_dict_metadata.get(fqn)
        if md is None:
            if strict:
                raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")
            continue
        if isinstance(md, TensorStorageMetadata) and getattr(obj, "size", None) is not None and md.size != obj.size():
            raise ValueError(f"Size mismatch between saved {md.size} and current: {obj.size()} for {fqn}")
        if isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None:
            continue
        if isinstance(md, BytesStorageMetadata):
            requests += create_read_items(fqn, md, obj)
        else:
            try:
                chunks = create_chunk_list(obj)
            except ValueError as ex:
                raise ValueError(f"Invalid checkpoint metadata for {fqn}, "
                                 f"expected BytesStorageMetadata but found {type(md)}") from ex
            requests += read_items_for_chunks(fqn, md, chunks)
    return LoadPlan(requests)


class LocalLoadPlanner(SafeLoadPlanner):
    """``SafeLoadPlanner`` that keeps its local load plan to itself. DCP's global load plan returns every rank's
    plan unchanged, and our storage readers prepare none: gathering them only cost the coordinator unpickling
    every rank's read items. Each rank sends an empty plan and reads with its own, made by ``local_load_plan``
    (linear in the number of saved chunks)."""

    _LOCAL = "local"

    def create_local_plan(self) -> LoadPlan:
        if self.metadata is None:
            raise AssertionError("self.metadata is not None")
        if self.flatten_state_dict:  # as DefaultLoadPlanner: keys of a checkpoint saved before torch 2.4
            missing = set(self.metadata.state_dict_metadata) - set(self.state_dict)
            if missing:
                with saved_before_2_4():
                    old_state, old_mappings = flatten_state_dict(self.original_state_dict)
                if set(old_state) & missing:
                    self.state_dict, self.mappings = old_state, old_mappings
        self._local = local_load_plan(self.state_dict, self.metadata, not self.allow_partial_load)
        return LoadPlan([], planner_data=self._LOCAL)

    def finish_plan(self, new_plan: LoadPlan) -> LoadPlan:
        if new_plan.planner_data != self._LOCAL or new_plan.items:
            raise ValueError("the coordinator changed a load plan that LocalLoadPlanner keeps to itself")
        return self._local
