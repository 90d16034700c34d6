"""Save planning whose coordinator work is linear in the rank count, and cached across saves of one layout.

``LinearSavePlanner`` is DCP's ``DefaultSavePlanner`` with two changes, both on the coordinator's side:

* **Linear validation.** DCP checks that no two chunks of a tensor overlap with a sweep along the tensor's longest
  dimension; when the shards are cut along another one (FSDP's dim 0 of ``down_proj``, ``k_proj``: 8,192 x 28,672
  and 1,024 x 8,192 in Llama-3-70B) every chunk is active at once and the sweep compares every pair: quadratic in
  the rank count (36.8 s of planning at 1,024 ranks, 722 tensors). Here a tensor's chunks pass when, along every
  dimension, their distinct intervals tile the dimension exactly and no two chunks start at the same offsets: each
  chunk is then one cell of a grid, so none overlaps another; with the volume check (kept from DCP), every cell is
  present. Every layout FSDP, HSDP and TP produce is such a grid; anything else falls back to the sweep, on the
  dimension with the most distinct offsets. Chunks without elements (the shards past the end of a dimension that
  has fewer rows than ranks) only need to lie within bounds.
* **A cache across saves.** Each rank fingerprints its local plan (the items, their offsets, sizes and dtypes, the
  state's key mapping). When it equals the one of this rank's last save under the same ``key`` (a state folder
  of the checkpoint, e.g. ``model``), the rank sends the coordinator a plan with no items and the fingerprint; when
  every rank does, and the coordinator holds the same fingerprints for every rank, the cached global plan and
  metadata are reused and every rank gets an empty plan back (then writes its cached final plan). Anything else
  (another world size, strategy, parameter set, shape or dtype) is planned afresh and replaces the cache. An entry
  is taken out of the cache when a save starts and put back only when its plan is final, so a save that fails
  leaves nothing stale; the coordinator refuses (on every rank) a fingerprint it does not hold.

Torch's own ``enable_plan_caching`` keys its class-level cache by the planner's class name, so a model save and
an optimizer save evict each other's entries at every checkpoint; its validation is the sweep above.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import pickle
from collections import ChainMap
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import (
    DefaultSavePlanner,
    _validate_global_plan,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, WriteItem, WriteItemType

from automodel_ckpt.ondisk.formats.safe_load import SafeLoadPlanner


@dataclass(frozen=True)
class PlanNote:
    """What a rank sends the coordinator in place of its local plan's items: the plan's fingerprint, and unless
    the plan is unchanged, its items as plain tuples (``_encode``) and the state's key mapping (DCP's
    ``planner_data``). Unpickling DCP's ``WriteItem`` objects costs the coordinator ~30 us an item (722 items a
    rank for Llama-3-70B); tuples of strings and ints a fraction of that."""

    fingerprint: str
    entries: list[tuple] | None = None
    properties: list[Any] | None = None
    mappings: Any = None


@dataclass(frozen=True)
class PlanReply:
    """What the coordinator sends each rank back: for each of its local items, its index hint in the metadata
    (``-1``: kept as it is, a plain value; ``None``: another rank writes it)."""

    hints: list[int | None]


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
            entries.append((wi.index.fqn, wi.type.value, offset, None, None, None, None, wi.bytes_io_data))
            continue
        p = td.properties
        key = (p.dtype, p.layout, p.requires_grad, p.memory_format, p.pin_memory)
        if key not in table:
            table[key] = len(props)
            props.append(p)
        chunk = td.chunk
        entries.append((wi.index.fqn, wi.type.value, offset, None if chunk is None else tuple(chunk.offsets),
                        None if chunk is None else tuple(chunk.sizes), tuple(td.size), table[key], wi.bytes_io_data))
    return entries, props


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
        self.plan = SavePlan([], planner_data=PlanNote(self._fingerprint, entries, props, mappings))
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
            for rank, note in enumerate(notes):
                if note.entries is None:  # unchanged: the coordinator holds it, or the save cannot go on
                    if entry is None or entry.notes[rank].fingerprint != note.fingerprint:
                        raise ValueError(f"rank {rank} sent an unchanged save plan that the coordinator does not hold")
                    note = entry.notes[rank]
                full.append(note)
            hints, metadata = plan_globally(full, self.flatten_state_dict)
            entry = _CoordinatorEntry(full, metadata)
            replies = [SavePlan([], planner_data=PlanReply(h)) for h in hints]
        if cache_key is not None:
            _COORDINATOR_CACHE[cache_key] = entry
        self.metadata = dataclasses.replace(metadata)  # the storage writer sets storage_data on its own copy
        return replies, self.metadata


def _apply(items: list[WriteItem], hints: list[int | None]) -> list[WriteItem]:
    """A rank's global plan from its local items and the coordinator's hints (as DCP's global plan has them)."""
    out = []
    for item, hint in zip(items, hints, strict=True):
        if hint is None:
            continue
        out.append(item if hint < 0 else dataclasses.replace(item, index=dataclasses.replace(item.index, index=hint)))
    return out


def plan_globally(notes: list[PlanNote], flatten: bool = True) -> tuple[list[list[int | None]], Metadata]:
    """DCP's dedup (``dedup_save_plans``: an item several ranks hold goes to the one with the least planned so
    far), global plan (``create_default_global_save_plan``: index hints, the metadata) and merged mappings, on
    the ranks' encoded plans; validated linearly. Raises ``ValueError`` as DCP does for an invalid plan."""
    owners = _dedup(notes)
    md: dict[str, Any] = {}
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
            tensor_md = md.get(fqn)
            if tensor_md is None:
                tensor_md = md[fqn] = TensorStorageMetadata(properties=note.properties[prop], size=torch.Size(size),
                                                            chunks=[])
            if c_off is None:
                raise AssertionError(f"Cannot create MD for tensor without bounds. FQN: {fqn}")
            hints.append(len(tensor_md.chunks))
            tensor_md.chunks.append(ChunkStorageMetadata(offsets=torch.Size(c_off), sizes=torch.Size(c_size)))
        hints_of.append(hints)
    metadata = Metadata(md)
    if flatten:
        metadata = dataclasses.replace(metadata, planner_data=dict(ChainMap(*[n.mappings for n in notes])))
    errors = validate(len(notes), metadata)
    if errors:
        summary = "; ".join(errors)
        raise ValueError(f"Failed to validate global plan: {summary[:500]}{'... (truncated)' if len(summary) > 500 else ''}")
    return hints_of, metadata


_SHARD, _BYTE_IO = WriteItemType.SHARD.value, WriteItemType.BYTE_IO.value


def _dedup(notes: list[PlanNote]) -> list[list[bool]]:
    """Which rank writes each item (``dedup_save_plans``, the same choices): ``[rank][item]`` True where it does."""
    first: dict[tuple, int] = {}  # item -> the one rank holding it, or -1 once several do (then in ``several``)
    several: dict[tuple, set[int]] = {}
    storage: dict[tuple, int] = {}
    for rank, note in enumerate(notes):
        for fqn, _kind, offset, _co, _cs, size, prop, _ in note.entries:
            key = (fqn, offset)
            holder = first.setdefault(key, rank)
            if holder != rank and holder != -1:
                several[key] = {holder}
                first[key] = -1
            if holder != rank:
                several[key].add(rank)
            if key not in storage:
                storage[key] = (math.prod(size) * note.properties[prop].dtype.itemsize) if size is not None else 0
    load = [0] * len(notes)
    writer: dict[tuple, int] = {}
    for key, holder in first.items():  # in the order items first appear, as DCP walks them
        chosen = holder if holder != -1 else min(several[key], key=lambda r: load[r])
        writer[key] = chosen
        load[chosen] += storage[key] or 1
    return [[writer[(e[0], e[2])] == rank for e in note.entries] for rank, note in enumerate(notes)]


def validate(ranks: int, metadata: Metadata) -> list[str]:
    """DCP's checks of a global plan (every chunk within bounds, no two overlapping, all of them covering the
    tensor when more than one rank saves), in time linear in the number of chunks for grid layouts."""
    errors: list[str] = []
    irregular: dict[str, Any] = {}
    for key, value in metadata.state_dict_metadata.items():
        if isinstance(value, BytesStorageMetadata) or len(value.size) == 0:
            continue
        size, chunks = tuple(value.size), value.chunks
        volume = 0
        for chunk in chunks:
            if any(o < 0 or n < 0 or o + n > s for o, n, s in zip(chunk.offsets, chunk.sizes, size)):
                errors.append(f"key:{key} has out of bounds chunk: tensor-size:{value.size} chunk: {chunk}")
            volume += math.prod(chunk.sizes)
        if len(chunks) > 1 and not _is_grid(size, chunks):
            irregular[key] = value
        if ranks > 1 and volume != math.prod(size):
            errors.append(f"key:{key} invalid fill tensor-volume: {math.prod(size)} chunks-volume: {volume}")
    if irregular:  # DCP's sweep, on the dimension with the most distinct offsets; its coverage check is above
        for message in _validate_global_plan([SavePlan([])] * ranks, Metadata(_swept(irregular))):
            if "invalid fill" not in message:
                errors.append(message)
    return errors


def _is_grid(size: tuple[int, ...], chunks: list[Any]) -> bool:
    """Whether the non-empty chunks are distinct cells of one grid: along each dimension their intervals tile it
    exactly (a partition), and no two start at the same offsets. Then no two overlap."""
    full = [c for c in chunks if all(n > 0 for n in c.sizes)]
    if len({tuple(c.offsets) for c in full}) != len(full):
        return False
    for d, extent in enumerate(size):
        ends: dict[int, int] = {}
        for c in full:
            start, end = c.offsets[d], c.offsets[d] + c.sizes[d]
            if ends.setdefault(start, end) != end:
                return False
        at, steps = 0, 0
        while at in ends and steps <= len(ends):
            at, steps = ends[at], steps + 1
        if full and (at != extent or steps != len(ends)):
            return False
    return True


def _swept(irregular: dict[str, Any]) -> dict[str, Any]:
    """``irregular``'s tensors with the dimension of most distinct offsets made the longest, so that DCP's sweep
    (along the longest) runs along it and the chunks rarely stay active together."""
    out = {}
    for key, value in irregular.items():
        best = max(range(len(value.size)), key=lambda d: len({c.offsets[d] for c in value.chunks}))
        size = [n + (sum(value.size) + 1 if d == best else 0) for d, n in enumerate(value.size)]
        out[key] = dataclasses.replace(value, size=size)
    return out


class LocalLoadPlanner(SafeLoadPlanner):
    """``SafeLoadPlanner`` that keeps its local load plan to itself. DCP's global load plan returns every rank's
    plan unchanged, and our storage readers prepare none: gathering them only cost the coordinator unpickling
    every rank's read items. Each rank sends an empty plan and reads with its own."""

    _LOCAL = "local"

    def create_local_plan(self) -> LoadPlan:
        self._local = super().create_local_plan()
        return LoadPlan([], planner_data=self._LOCAL)

    def finish_plan(self, new_plan: LoadPlan) -> LoadPlan:
        if new_plan.planner_data != self._LOCAL or new_plan.items:
            raise ValueError("the coordinator changed a load plan that LocalLoadPlanner keeps to itself")
        return self._local
