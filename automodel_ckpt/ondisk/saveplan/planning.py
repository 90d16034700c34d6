"""Save and load planning linear in the rank count, save plans cached across saves of one layout.

``LinearSavePlanner`` is DCP's ``DefaultSavePlanner`` validated linearly (``plan_checks``) with its plans cached
across saves of an unchanged layout; ``LocalLoadPlanner`` keeps each rank's load plan to itself. The rules and
why: docs/checkpointing.md; measurements: docs/benchmarks.md."""

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
from torch.distributed.checkpoint.default_planner import (DefaultSavePlanner, create_default_global_save_plan,
                                                          create_default_local_save_plan)
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (BytesIOWriteData, LoadPlan, SavePlan, TensorWriteData, WriteItem,
                                                  WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor

from automodel_ckpt.distributed.dcp_private import (create_chunk_list, create_read_item_for_tensor, create_read_items,
                                                 dedup_save_plans, flatten_state_dict, saved_before_2_4,
                                                 shards_overlap_region)
from automodel_ckpt.ondisk.saveplan import plan_columns
from automodel_ckpt.ondisk.saveplan.packed import Packed, Unpacker, items_packed, pack
from automodel_ckpt.ondisk.saveplan.plan_checks import validate
from automodel_ckpt.ondisk.saveplan.plan_columns import Columns, joined, split
from automodel_ckpt.ondisk.formats.safe_load import SafeLoadPlanner


@dataclass(frozen=True)
class PlanNote:
    """What a rank sends in place of its plan's items (~30 us each to unpickle): the fingerprint, and unless
    unchanged, the items (``Columns`` where they fit, else ``_encode``'s tuples) and key mapping, ``Packed``."""

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
    """Each local item's index hint in the metadata, as int64 bytes (-1: kept as it is; -2: another rank's)."""

    hints: bytes


@dataclass
class _RankEntry:
    fingerprint: str
    final_plan: SavePlan
    shape: list | None = None  # what the state planned was made of (``_shape``), and its local plan
    local: SavePlan | None = None


@dataclass
class _CoordinatorEntry:
    notes: list[PlanNote]
    metadata: Metadata


#: per process: (key, world size, rank) -> this rank's last final plan; (key, world size) -> the coordinator's
_RANK_CACHE: dict[tuple[str, int, int], _RankEntry] = {}
_COORDINATOR_CACHE: dict[tuple[str, int], _CoordinatorEntry] = {}


def _shape(state: dict, coordinator: bool) -> list | None:
    """What DCP's local save plan of ``state`` is made of; None where that cannot be told (it is made anew)."""
    out: list = [coordinator]
    for key, v in state.items():
        local = v._local_tensor if type(v) is DTensor else v
        if type(local) in (torch.Tensor, torch.nn.Parameter):
            what = v._spec if type(v) is DTensor else (v.shape, v.dtype, v.layout)
            out.append((key, what, local.requires_grad, local.is_pinned()))
        elif isinstance(v, torch.Tensor) or hasattr(v, "__create_write_items__"):
            return None  # another tensor subclass, or an object that makes its own write items
        else:
            out.append(key)
    return out


def clear_cache() -> None:
    """Forget every cached plan of this process."""
    _RANK_CACHE.clear()
    _COORDINATOR_CACHE.clear()


def _encode(plan: SavePlan) -> tuple[list[tuple], list[Any]]:
    """``plan``'s items as ``(fqn, type, offset, chunk offsets, chunk sizes, size, properties #, bytes data)``."""
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
    """A digest of what decides the global plan and the metadata: the items and the state's key mapping."""
    props = [(str(p.dtype), str(p.layout), p.requires_grad, str(p.memory_format), p.pin_memory) for p in properties]
    return hashlib.blake2b(pickle.dumps((entries, props, mappings), protocol=4), digest_size=16).hexdigest()


class LinearSavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner``'s plans and metadata, validated linearly, cached per ``key`` (None: never)."""

    def __init__(self, key: str | None = None, *, world_size: int = 1, rank: int = 0) -> None:
        super().__init__()
        self.key, self.world_size, self.rank = key, world_size, rank
        self.reused = False  # whether this save's plan came from the cache
        self._fingerprint: str | None = None
        self._local: SavePlan | None = None
        self._cached: _RankEntry | None = None
        self._made: tuple = (None, None)  # (``_shape`` of the state, the local plan made of it)

    # ----------------------------------------------------------------------------------------- every rank
    def create_local_plan(self) -> SavePlan:
        """DCP's local plan, or the one this rank made for a state of the same ``_shape`` at its last save."""
        shape = _shape(self.state_dict, self.is_coordinator) if self.key is not None else None  # else never kept
        kept = _RANK_CACHE.get((self.key, self.world_size, self.rank))
        self._made = shape, kept.local if shape is not None and kept is not None and kept.shape == shape else \
            create_default_local_save_plan(self.state_dict, self.is_coordinator)
        return self.outgoing(self._made[1])

    def outgoing(self, plan: SavePlan) -> SavePlan:
        """The ``PlanNote`` this rank sends for ``plan``: its fingerprint alone when it is this rank's last one."""
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
            _RANK_CACHE[(self.key, self.world_size, self.rank)] = _RankEntry(self._fingerprint, final, *self._made)
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


MANY_OBJECTS = 100_000  # new tracked objects past which ``gc_paused`` moves them to the oldest generation
GC_PAUSED_FROM = 256  # ranks from which a save's coordinator runs the whole save in ``gc_paused``


def coordinating(world_size: int, rank: int) -> Any:
    """``gc_paused`` on the coordinator of a large save (it unpickles every rank's plan and results), else nothing."""
    return gc_paused() if rank == 0 and world_size >= GC_PAUSED_FROM else nullcontext()


@contextmanager
def gc_paused():
    """No cyclic garbage collection while millions of acyclic objects are made (chunks, indices): collections
    made planning superlinear. On the way out, past ``MANY_OBJECTS`` new ones, they move to the oldest
    generation (``gc.freeze`` then ``gc.unfreeze``): they are long-lived (cached), and no young collection walks
    them. Objects the process froze before are unfrozen with them."""
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
    """A rank's global plan from its local items and the coordinator's hints."""
    return [item if hint == -1 else dataclasses.replace(item, index=dataclasses.replace(item.index, index=hint))
            for item, hint in zip(items, np.frombuffer(hints, dtype=np.int64).tolist(), strict=True) if hint != -2]


def plan_globally(notes: list[PlanNote], flatten: bool = True) -> tuple[list[np.ndarray], Metadata]:
    """DCP's dedup, global plan (index hints, metadata) and merged mappings on the ranks' encoded plans, validated
    linearly: on columns (``plan_columns``) where every rank's fit them, else by DCP's own functions on the items
    decoded (plans of another shape, rare: DCP's are quadratic), raising as DCP does. Hints: int64, -1 kept as it
    is, -2 written by another rank."""
    if notes and all(isinstance(n.entries, Columns) for n in notes):
        found = plan_columns.plan(notes)
        if found is not None:
            hints_of, md, bounds = found
            return hints_of, _finished(notes, md, bounds, flatten)
    plans = [SavePlan(_decoded(note)) for note in notes]
    finals, metadata = create_default_global_save_plan(dedup_save_plans(plans))
    hints_of = []
    for plan, final in zip(plans, finals):  # a rank's kept items are its items in order, less those deduped
        kept, hints = iter(final.items), []
        found = next(kept, None)
        for item in plan.items:
            if found is not None and found.index == item.index:
                hints.append(-1 if found.index.index is None else found.index.index)
                found = next(kept, None)
            else:
                hints.append(-2)
        hints_of.append(np.array(hints, dtype=np.int64))
    return hints_of, _finished(notes, metadata.state_dict_metadata, None, flatten)


def _decoded(note: PlanNote) -> list[WriteItem]:
    """A rank's encoded items (``_encode``, or ``Columns``) as DCP's ``WriteItem`` objects again."""
    items = []
    for fqn, kind, offset, c_off, c_size, size, prop, data in (
            joined(note.entries) if isinstance(note.entries, Columns) else note.entries):
        chunk = None if c_off is None else ChunkStorageMetadata(torch.Size(c_off), torch.Size(c_size))
        tensor = None if size is None else TensorWriteData(chunk, note.properties[prop], torch.Size(size))
        items.append(WriteItem(MetadataIndex(fqn, None if offset is None else torch.Size(offset)), WriteItemType(kind),
                               bytes_io_data=None if data is None else BytesIOWriteData(**dict(data)),
                               tensor_data=tensor))
    return items


def _finished(notes: list[PlanNote], md: dict[str, Any], bounds: dict[str, tuple] | None, flatten: bool) -> Metadata:
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
    """``dict(ChainMap(*mappings))`` (DCP's merge) by one ``update`` per rank, last first: linear in the ranks."""
    merged: dict = {}
    done: set[int] = set()
    for mapping in reversed(mappings):
        if id(mapping) not in done:  # the same mapping again (``Packed``: one object for every rank that sent it)
            done.add(id(mapping))
            merged.update(mapping)
    return merged


_OFFSETS, _SIZES = attrgetter("offsets"), attrgetter("sizes")
_FEW_CHUNKS = 16  # a tensor saved in at most this many chunks is searched by DCP itself (tens of microseconds less)


def read_items_for_chunks(fqn: str, md: TensorStorageMetadata, local_chunks: list[ChunkStorageMetadata]) -> list:
    """DCP's ``create_read_items_for_chunk_list`` (the same items, same order) linear in the saved chunks: each
    local chunk is compared with all of them at once in numpy, its overlaps ordered as DCP's sweep meets them (by
    end along the sweep dimension, then index). Few chunks, or chunks of differing ranks, go to DCP's own."""
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
    """``SafeLoadPlanner`` that keeps its local load plan to itself (DCP's global plan changes none): sends none."""

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
