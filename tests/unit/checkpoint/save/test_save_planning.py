"""LinearSavePlanner: DCP's plans and metadata, a linear validation that still catches overlaps, gaps and chunks
out of bounds, and a cache that serves an unchanged layout and nothing else."""

from __future__ import annotations

import dataclasses
import importlib.util
import pickle
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.metadata import TensorProperties

from automodel_ckpt.ondisk.saveplan import plan_results, planning

_SPEC = importlib.util.spec_from_file_location("scale_sim", Path(__file__).parents[4] / "tools" / "scale_sim.py")
sim = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(sim)


@pytest.fixture(autouse=True)
def _fresh_cache():
    planning.clear_cache()
    plan_results.clear_cache()
    yield
    planning.clear_cache()
    plan_results.clear_cache()


def _dcp(layout: str, strategy: str, n: int):
    """DCP's own global plan and metadata for the same local plans (``DefaultSavePlanner``)."""
    planner = DefaultSavePlanner()
    plans = [pickle.loads(pickle.dumps(sim.local_plan(layout, strategy, n, r))) for r in range(n)]
    plans = [type(p)(p.items, planner_data=sim.mappings(layout)) for p in plans]
    return planner.create_global_plan(plans)


@pytest.fixture
def planned_on(monkeypatch):
    """Which way each global plan went: ``"columns"`` (``plan_columns``) or ``"tuples"``; ``force("tuples")``
    sends every plan the tuple way."""
    from automodel_ckpt.ondisk.saveplan import plan_columns

    ways, original = [], plan_columns.plan

    def spying(notes):
        found = None if ways and ways[0] == "force tuples" else original(notes)
        ways.append("columns" if found is not None else "tuples")
        return found

    monkeypatch.setattr(plan_columns, "plan", spying)
    return ways


@pytest.mark.parametrize("way", ["columns", "tuples"])
@pytest.mark.parametrize("strategy", ["fsdp", "hsdp", "tp-fsdp"])
def test_plans_and_metadata_are_dcps(strategy, way, planned_on):
    n = 16
    if way == "tuples":
        planned_on.append("force tuples")
    ours = sim.save("tiny", strategy, n)
    assert planned_on[-1] == way
    global_plan, metadata = _dcp("tiny", strategy, n)
    assert [p.items for p in ours["final_plans"]] == [p.items for p in global_plan]
    assert repr([p.items for p in ours["final_plans"]]) == repr([p.items for p in global_plan])  # Size, not tuple
    assert ours["metadata"] == metadata and repr(ours["metadata"]) == repr(metadata)


def test_the_next_save_of_the_same_layout_reuses_the_cache_and_gives_the_same_plans():
    first = sim.save("llama3-8b", "fsdp", 8)
    second = sim.save("llama3-8b", "fsdp", 8)
    assert not first["reused"] and second["reused"]
    assert repr(second["final_plans"]) == repr(first["final_plans"]) and second["metadata"] == first["metadata"]
    assert second["object_bytes_per_rank"] < first["object_bytes_per_rank"] / 2  # digests, not plans


def test_write_results_go_as_tuples_then_as_digests_and_come_back_whole():
    """A ``.distcp`` folder's finish reads every rank's write results: the first save sends them as tuples, the
    next (same layout) their digests only, and the coordinator rebuilds the same ``WriteResult`` objects."""
    first = sim.save("tiny", "fsdp", 4, results_needed=True)
    second = sim.save("tiny", "fsdp", 4, results_needed=True)
    assert second["results"] == first["results"] and repr(second["results"]) == repr(first["results"])
    assert len(first["results"]) == 4 and all(len(r) == 8 for r in first["results"])
    assert second["object_bytes_per_rank"] < first["object_bytes_per_rank"]
    plan_results._COORDINATOR.clear()  # a digest the coordinator does not hold fails the save
    with pytest.raises(ValueError, match="does not hold"):
        sim.save("tiny", "fsdp", 4, results_needed=True)


def test_saves_of_two_roots_that_overlap_each_find_their_own_cache_entries(tmp_path):
    """The node-local tier's step, written in the background, may overlap a durable save of the same state folder:
    each root has its own cache key, so neither save takes the entry the other's digest needs."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.storage import WriteResult

    from automodel_ckpt.ondisk.formats.sharded import cache_key

    results = [WriteResult(index=MetadataIndex("w", (0,), 0), size_in_bytes=8,
                           storage_data=_StorageInfo("__0_0.distcp", 0, 8))]
    writer = object()
    durable = cache_key(tmp_path / "run" / ".staging-epoch_0_step_8" / "optim", writer)
    local = cache_key(tmp_path / "loc" / ".staging-epoch_0_step_7" / "optim", writer)
    assert durable != local and durable == cache_key(tmp_path / "run" / ".staging-epoch_0_step_4" / "optim", writer)
    for key in (durable, local):  # each tier's first save: sent whole, then cached on both sides
        note = plan_results.outgoing(results, key, 1, 0)
        plan_results.incoming([note], key, needed=True)
        plan_results.succeeded(key, 1, 0, note)
    local_note = plan_results.outgoing(results, local, 1, 0)  # the two tiers' next saves overlap
    durable_note = plan_results.outgoing(results, durable, 1, 0)
    assert local_note.tuples is None and durable_note.tuples is None  # both unchanged: digests only
    assert plan_results.incoming([durable_note], durable, needed=True) == [results]
    assert plan_results.incoming([local_note], local, needed=True) == [results]


@pytest.mark.parametrize("change", ["world_size", "strategy", "parameters"])
def test_a_changed_layout_is_planned_afresh(change):
    sim.save("tiny", "fsdp", 16)  # (at 8 ranks HSDP's mesh is 1 x 8: the same chunks as FSDP's, rightly reused)
    layout, strategy, n = {"world_size": ("tiny", "fsdp", 8), "strategy": ("tiny", "hsdp", 16),
                           "parameters": ("llama3-8b", "fsdp", 16)}[change]
    again = sim.save(layout, strategy, n)
    assert not again["reused"]
    global_plan, metadata = _dcp(layout, strategy, n)
    assert again["metadata"] == metadata and [p.items for p in again["final_plans"]] == [p.items for p in global_plan]
    assert sim.save(layout, strategy, n)["reused"]


def test_one_rank_that_changed_replans_every_rank():
    sim.save("tiny", "fsdp", 4)
    planners, sent = [], []
    for rank in range(4):
        planner = planning.LinearSavePlanner("model", world_size=4, rank=rank)
        planner.mappings, planner.is_coordinator = sim.mappings("tiny"), rank == 0
        plan = sim.local_plan("tiny", "fsdp", 4, rank, dtype=torch.bfloat16 if rank == 3 else torch.float32)
        sent.append(planner.outgoing(plan))
        planners.append(planner)
    assert [p.planner_data.entries is None for p in sent] == [True, True, True, False]
    replies, metadata = planners[0].create_global_plan(sent)
    assert not planners[0].reused and all(r.usable for r in replies)
    finals = [pl.finish_plan(r) for pl, r in zip(planners, replies)]
    assert finals[3].items[0].tensor_data.properties.dtype == torch.bfloat16 and len(finals[0].items) == 8


def test_a_fingerprint_the_coordinator_does_not_hold_fails_the_save():
    sim.save("tiny", "fsdp", 2)
    planning._COORDINATOR_CACHE.clear()  # as if the coordinator had lost its entry
    planners = [planning.LinearSavePlanner("model", world_size=2, rank=r) for r in range(2)]
    sent = []
    for rank, planner in enumerate(planners):
        planner.mappings, planner.is_coordinator = sim.mappings("tiny"), rank == 0
        sent.append(planner.outgoing(sim.local_plan("tiny", "fsdp", 2, rank)))
    with pytest.raises(ValueError, match="does not hold"):
        planners[0].create_global_plan(sent)
    assert planning._RANK_CACHE == {}  # taken out when the save started: the next one sends full plans
    assert not sim.save("tiny", "fsdp", 2)["reused"]


def _md(size, chunks):
    props = TensorProperties(dtype=torch.float32)
    return Metadata({"w": TensorStorageMetadata(props, torch.Size(size), [
        ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks])})


@pytest.mark.parametrize("chunks,error", [
    ([((0, 0), (4, 8)), ((4, 0), (4, 8))], None),
    ([((0, 0), (4, 4)), ((0, 4), (4, 4)), ((4, 0), (4, 4)), ((4, 4), (4, 4))], None),  # a 2 x 2 grid
    ([((0, 0), (4, 8)), ((4, 0), (4, 8)), ((8, 0), (0, 8)), ((8, 0), (0, 8))], None),  # empty shards past the end
    ([((0, 0), (5, 8)), ((3, 0), (5, 8))], "overlapping"),
    ([((0, 0), (4, 8)), ((0, 0), (4, 8))], "overlapping"),
    ([((0, 0), (8, 4)), ((0, 2), (4, 6)), ((4, 4), (4, 4))], "overlapping"),
    ([((0, 0), (4, 8)), ((5, 0), (3, 8))], "invalid fill"),
    ([((0, 0), (4, 8)), ((4, 0), (5, 8))], "out of bounds"),
])
def test_validation_finds_what_dcps_finds(chunks, error):
    errors = planning.validate(2, _md((8, 8), chunks))
    if error is None:
        assert errors == []
    else:
        assert any(error in e for e in errors), errors


def test_validation_is_linear_where_dcps_sweep_is_quadratic():
    """Chunks cut along dim 0 of a tensor longer along dim 1 (Llama's down_proj): DCP's sweep keeps all of them
    active at once and compares every pair; counted in box comparisons, ours makes none."""
    from torch.distributed.checkpoint import default_planner

    n = 512
    md = _md((n, 4 * n), [((i, 0), (1, 4 * n)) for i in range(n)])
    calls = {"n": 0}
    original = default_planner._check_box_overlap

    def counting(a, b):
        calls["n"] += 1
        return original(a, b)

    default_planner._check_box_overlap = counting
    try:
        assert planning.validate(n, md) == []
        assert calls["n"] == 0
        default_planner._validate_global_plan([None] * n, md)
        assert calls["n"] == n * (n - 1) // 2
    finally:
        default_planner._check_box_overlap = original


def test_dedup_assigns_as_dcp_where_duplicates_follow_a_ranks_own_items():
    """Random plans mixing items only one rank holds with items several hold (a plain value among them), first
    appearing at any rank, of differing sizes: the writer of each is DCP's (``dedup_save_plans``)."""
    import random

    from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans

    from automodel_ckpt.ondisk.saveplan import plan_columns

    rng = random.Random(0)
    props = TensorProperties(dtype=torch.float32)
    for _ in range(200):
        plans = _random_plans(rng, props)
        kept = [{item.index for item in p.items} for p in dedup_save_plans(plans)]
        hints_of, _, _ = plan_columns.plan(planning._unpacked(_columns(plans)))
        assert [{i.index for i, h in zip(p.items, hints.tolist()) if h != -2} for p, hints in zip(plans, hints_of)] \
            == kept


def test_dedup_breaks_ties_as_dcp_among_hundreds_of_holders():
    """HSDP's shape: every replica holds the same items, so loads tie among hundreds of ranks and the writer is
    the first of DCP's set of holders in its iteration order (not the lowest rank once the set is large)."""
    from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    from automodel_ckpt.ondisk.saveplan import plan_columns  # the columns: each replica's numbers planned once

    props = TensorProperties(dtype=torch.float32)
    plans = []
    for rank in range(600):
        items = []
        for name in range(6):  # replicated across 75 groups of 8; the shard of each name depends on rank % 8
            rows = 8 + name
            offsets = torch.Size(((rank % 8) * rows, 0))
            items.append(WriteItem(MetadataIndex(f"w{name}", offsets), WriteItemType.SHARD, tensor_data=TensorWriteData(
                ChunkStorageMetadata(offsets, torch.Size((rows, 3))), props, torch.Size((8 * rows, 3)))))
        items.append(WriteItem(MetadataIndex(f"own{rank}", torch.Size((0,))), WriteItemType.SHARD,
                               tensor_data=TensorWriteData(ChunkStorageMetadata(torch.Size((0,)), torch.Size((rank,))),
                                                           props, torch.Size((rank,)))))
        plans.append(SavePlan(items))
    kept = [{item.index for item in p.items} for p in dedup_save_plans(plans)]
    hints_of, _, _ = plan_columns.plan(planning._unpacked(_columns(plans)))
    assert [{i.index for i, h in zip(p.items, hints.tolist()) if h != -2} for p, hints in zip(plans, hints_of)] == kept
    assert sum(int((hints != -2).sum()) for hints in hints_of) == 8 * 6 + 600


@pytest.mark.parametrize("enabled", [True, False])
def test_planning_pauses_the_collector_and_leaves_what_it_made_to_the_oldest_generation(enabled):
    import gc

    (gc.enable if enabled else gc.disable)()
    try:
        with planning.gc_paused():
            assert not gc.isenabled()
            made = [[i] for i in range(planning.MANY_OBJECTS + 1)]  # tracked objects, no collection
        assert gc.isenabled() == enabled
        assert gc.get_count()[0] < planning.MANY_OBJECTS  # moved on without a walk, not left young
        assert any(obj is made for obj in gc.get_objects(generation=2))
    finally:
        gc.enable()


def test_the_ranks_key_mappings_merge_as_chainmap_merges_them():
    """Each key from the first rank that has it, the keys in ChainMap's order, as DCP's ``dict(ChainMap(...))``."""
    import random
    from collections import ChainMap

    rng = random.Random(3)
    mappings = [{f"k{rng.randrange(40)}": (rank, rng.random()) for _ in range(rng.randrange(30))} for rank in range(9)]
    merged = planning.merged_mappings(mappings)
    expected = dict(ChainMap(*mappings))
    assert merged == expected and list(merged) == list(expected)
    assert any(len({m[k][0] for m in mappings if k in m}) > 1 for k in merged)  # keys held by several ranks


@pytest.mark.parametrize("world, rank, paused", [(planning.GC_PAUSED_FROM, 0, True), (planning.GC_PAUSED_FROM, 1, False),
                                                  (planning.GC_PAUSED_FROM - 1, 0, False)])
def test_a_large_saves_coordinator_runs_it_without_the_collector(tmp_path, monkeypatch, world, rank, paused):
    """From GC_PAUSED_FROM ranks on, rank 0 (which unpickles every rank's plan and write results as they are
    gathered) runs the save with the collector paused, and turns it back on after; other ranks and smaller saves
    keep it running."""
    import gc

    import torch.distributed as dist

    from automodel_ckpt.ondisk.formats import sharded
    from automodel_ckpt.ondisk.fastio import ParallelFileSystemWriter

    seen = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
    monkeypatch.setattr(sharded.dcp, "save", lambda *a, **k: seen.append(gc.isenabled()))
    assert gc.isenabled()
    sharded._save({}, tmp_path / "optim", ParallelFileSystemWriter(tmp_path / "optim"), None)
    assert seen == [not paused] and gc.isenabled()


def test_the_coordinator_unpickles_each_distinct_packed_part_once(monkeypatch):
    """HSDP's replicas send the same items and every rank the same key mapping: each distinct pickle is unpickled
    once, and every rank that sent it gets the same object (the global plan is DCP's: the test above)."""
    n = 16  # two replica groups of 8
    notes = []
    for rank in range(n):
        planner = planning.LinearSavePlanner(None, world_size=n, rank=rank)
        planner.mappings, planner.is_coordinator = sim.mappings("tiny"), rank == 0
        notes.append(pickle.loads(pickle.dumps(planner.outgoing(sim.local_plan("tiny", "hsdp", n, rank)))).planner_data)
    assert all(isinstance(note.entries.items, planning.Packed) for note in notes)
    loads = []

    from automodel_ckpt.ondisk.saveplan import packed

    class Counted(packed.RestrictedUnpickler):  # plain values only: the restricted unpickler reads them
        def load(self):
            loads.append(1)
            return super().load()

    monkeypatch.setattr(packed, "RestrictedUnpickler", Counted)
    full = planning._unpacked(notes)
    assert len({note.entries.items.digest for note in notes}) == 1  # every rank holds the same items
    assert len({note.entries.numbers for note in notes}) == 8  # replicas: the same numbers
    assert len(loads) == 1 + 1  # and one key mapping for all
    for a, b in zip(notes, full):
        assert b.entries.items is full[0].entries.items and b.mappings is full[0].mappings
        assert b.entries.items == pickle.loads(a.entries.items.data) and b.properties == a.properties
        assert planning.joined(b.entries) == planning._encode(sim.local_plan("tiny", "hsdp", n, notes.index(a)))[0]


def _columns(plans):
    """Each plan's ``PlanNote`` with its items as ``Columns``."""
    notes = []
    for plan in plans:
        entries, props = planning._encode(plan)
        notes.append(planning.PlanNote("", planning.split(entries), props, {}))
    assert all(isinstance(n.entries, planning.Columns) for n in notes)
    return notes


def _random_plans(rng, props):
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    plans = []
    for _rank in range(rng.randint(2, 6)):
        items = []
        for name in rng.sample(range(8), rng.randint(1, 6)):
            rows, row = rng.choice([(4, 0), (4, 1), (2, rng.randint(0, 3))])
            size = torch.Size((16, 3 + name))  # one shape per name
            offsets = torch.Size((row * rows, 0))
            items.append(WriteItem(MetadataIndex(f"w{name}", offsets), WriteItemType.SHARD, tensor_data=TensorWriteData(
                ChunkStorageMetadata(offsets, torch.Size((rows, 3 + name))), props, size)))
        if rng.random() < 0.5:  # a plain value every rank holds
            items.insert(rng.randint(0, len(items)), WriteItem(MetadataIndex("lr"), WriteItemType.BYTE_IO))
        plans.append(SavePlan(items))
    return plans


def test_columns_dedup_and_order_chunks_as_dcp_for_ranks_holding_differing_items():
    """Random plans whose ranks hold differing items (several item lists): the columns' writers, chunk order and
    index hints are DCP's (``create_default_global_save_plan``: its dedup, then its metadata)."""
    import random

    from automodel_ckpt.ondisk.saveplan import plan_columns
    from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
    from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans

    rng = random.Random(1)
    props = TensorProperties(dtype=torch.float32)
    for _ in range(150):
        plans = _random_plans(rng, props)
        theirs, metadata = create_default_global_save_plan(dedup_save_plans(plans))
        hints_of, md, _ = plan_columns.plan(planning._unpacked(_columns(plans)))
        ours = [planning._apply(p.items, h.tobytes()) for p, h in zip(plans, hints_of)]
        assert ours == [p.items for p in theirs] and list(md) == list(metadata.state_dict_metadata)
        assert repr(md) == repr(metadata.state_dict_metadata)


def test_columns_keys_of_differing_tensors_never_meet():
    """Each item's dedup key is one integer: ``a``'s chunk at 2 (a tensor of 3) and ``b``'s at 0 (a tensor of 1)
    stay apart, as DCP's ``MetadataIndex`` keeps them, whatever the sizes and the names' order."""
    from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
    from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    from automodel_ckpt.ondisk.saveplan import plan_columns

    props = TensorProperties(dtype=torch.float32)

    def shard(name, offset, rows, total):
        at = torch.Size((offset,))
        return WriteItem(MetadataIndex(name, at), WriteItemType.SHARD, tensor_data=TensorWriteData(
            ChunkStorageMetadata(at, torch.Size((rows,))), props, torch.Size((total,))))

    for a, b in [(3, 1), (1, 3), (5, 2), (2, 7)]:
        for at in range(a):
            plans = [SavePlan([shard("a", 0, at, a), shard("b", 0, b, b)]), SavePlan([shard("a", at, a - at, a)])]
            theirs, metadata = create_default_global_save_plan(dedup_save_plans(plans))
            hints_of, md, _ = plan_columns.plan(planning._unpacked(_columns(plans)))
            assert [planning._apply(p.items, h.tobytes()) for p, h in zip(plans, hints_of)] == [p.items for p in theirs]
            assert repr(md) == repr(metadata.state_dict_metadata)


@pytest.mark.parametrize("case", ["out of bounds", "a negative offset", "bytes and a tensor",
                                  "a chunk apart from its index"])
def test_plans_that_do_not_fit_columns_go_the_tuple_way_and_fail_as_dcp(case, planned_on):
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    props = TensorProperties(dtype=torch.float32)

    def shard(name, offset, rows, total=8):
        at = torch.Size((offset, 0))
        return WriteItem(MetadataIndex(name, at), WriteItemType.SHARD, tensor_data=TensorWriteData(
            ChunkStorageMetadata(at, torch.Size((rows, 2))), props, torch.Size((total, 2))))

    plans = [SavePlan([shard("w", 0, 4)]), SavePlan([shard("w", 4, 4)])]
    if case == "out of bounds":  # found by the columns' validation
        plans[1] = SavePlan([shard("w", 4, 6)])
    elif case == "a negative offset":
        plans[1] = SavePlan([shard("w", -4, 4)])
    elif case == "bytes and a tensor":
        plans[1] = SavePlan([shard("w", 4, 4), WriteItem(MetadataIndex("w"), WriteItemType.BYTE_IO)])
    else:
        item = shard("w", 4, 4)
        plans[1] = SavePlan([dataclasses.replace(item, tensor_data=dataclasses.replace(
            item.tensor_data, chunk=ChunkStorageMetadata(torch.Size((5, 0)), torch.Size((3, 2)))))])
    notes = [planning.PlanNote("", planning.split(e) or e, p, {}) for e, p in map(planning._encode, plans)]
    expected = {"out of bounds": (ValueError, "out of bounds"), "a negative offset": (ValueError, "out of bounds"),
                "bytes and a tensor": (AssertionError, "not in md"),
                "a chunk apart from its index": (ValueError, "invalid fill")}[case]
    with pytest.raises(expected[0], match=expected[1]):
        planning.plan_globally(planning._unpacked(notes))
    assert planned_on == {"out of bounds": ["columns"], "a chunk apart from its index": []}.get(case, ["tuples"])


def test_the_metadata_a_save_broadcasts_is_hollow_and_its_file_whole(tmp_path):
    """DCP's save broadcasts the metadata its writer's finish was given to every rank (and returns it): emptied
    once the file is written, so that no save pickles every chunk a second time. The file holds it all, and the
    next save of the layout still reuses the cached plan and writes the same index."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from automodel_ckpt.ondisk.fastio import ParallelFileSystemWriter
    from automodel_ckpt.ondisk.formats.sharded import cache_key

    state = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(2), "step": 3}
    indexes = []
    for step in (1, 2):
        path = tmp_path / "run" / f".staging-{step}" / "optim"
        writer = ParallelFileSystemWriter(path)
        key = cache_key(path, writer)
        done = plan_results.keep_results(writer, key, 1, 0)
        planner = planning.LinearSavePlanner(key)
        returned = dcp.save(state, storage_writer=writer, planner=planner)
        done()
        assert returned.state_dict_metadata == {} and returned.storage_data is None and returned.planner_data is None
        assert planner.reused == (step == 2)
        on_disk = FileSystemReader(path).read_metadata()
        assert set(on_disk.state_dict_metadata) == {"w", "b", "step"} and len(on_disk.storage_data) == 3
        assert on_disk.state_dict_metadata["w"].size == torch.Size([3, 4])
        indexes.append((on_disk.state_dict_metadata, {k: vars(v) for k, v in on_disk.storage_data.items()}))
    assert indexes[0] == indexes[1]


def test_a_state_of_scalars_and_plain_values_plans_on_columns(tmp_path, planned_on):
    """No item with a dimension (a 0-dim parameter and its AdamW state, plain values): the columns have no
    offsets at all, and the plan is DCP's; saved twice through ``dcp.save``, the file holds every entry."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from automodel_ckpt.ondisk.fastio import ParallelFileSystemWriter
    from automodel_ckpt.ondisk.formats.sharded import cache_key

    state = {"w": torch.tensor(2.0), "exp_avg": torch.tensor(0.5), "step": torch.tensor(3.0), "lr": 0.1}
    for step in (1, 2):
        path = tmp_path / "run" / f".staging-{step}" / "optim"
        writer = ParallelFileSystemWriter(path)
        key = cache_key(path, writer)
        done = plan_results.keep_results(writer, key, 1, 0)
        dcp.save(state, storage_writer=writer, planner=planning.LinearSavePlanner(key))
        done()
        on_disk = FileSystemReader(path).read_metadata()
        assert set(on_disk.state_dict_metadata) == {"w", "exp_avg", "step", "lr"}
        assert on_disk.state_dict_metadata["w"].size == torch.Size([])
    assert planned_on == ["columns"]  # the second save reused the first's plan


@pytest.mark.parametrize("shape", [(32000, 64), (128, 8), (10, 3), (7, 5, 2), (1, 4), (130, 2)])
@pytest.mark.parametrize("n", [8, 64, 256])
def test_the_simulations_strided_shards_are_dtensors_at_every_rank(shape, n):
    """TP then FSDP: the closed form the simulation uses for FSDP's dim-0 shard strided inside TP's (DTensor's own
    splits an arange of the dim at every call: minutes at 4,096 ranks) is DTensor's at every rank, empty shards too."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    mesh = (n // sim.TP, sim.TP)
    placements = sim._placements("tp-fsdp", "q_proj.weight", len(shape))
    for rank in range(n):
        sizes, offsets = _compute_local_shape_and_global_offset(shape, mesh, [rank // sim.TP, rank % sim.TP],
                                                                placements)
        assert sim._strided(shape, mesh, rank) == (tuple(sizes), tuple(offsets)), rank


def test_an_unchanged_state_reuses_its_local_plan_and_a_changed_one_is_planned_again(tmp_path, process_group,
                                                                                      monkeypatch):
    """The local plan is made once per state of one shape (DTensor specs, shapes, dtypes, gradient flags, keys):
    a tensor that now needs gradients, or a key more, plans anew, and the files say so."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from automodel_ckpt.ondisk.fastio import ParallelFileSystemWriter
    from automodel_ckpt.ondisk.formats.sharded import cache_key

    made, original = [], planning.create_default_local_save_plan
    monkeypatch.setattr(planning, "create_default_local_save_plan", lambda *a: made.append(1) or original(*a))
    mesh = init_device_mesh("cpu", (1,))
    state = {"w": torch.zeros(3, 4), "d": distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]), "step": 3}

    def save(step: int) -> dict:
        path = tmp_path / "run" / f".staging-{step}" / "optim"
        writer = ParallelFileSystemWriter(path)
        done = plan_results.keep_results(writer, cache_key(path, writer), 1, 0)
        dcp.save(state, storage_writer=writer, planner=planning.LinearSavePlanner(cache_key(path, writer)))
        done()
        return FileSystemReader(path).read_metadata().state_dict_metadata

    save(1)
    state["w"].add_(1.0)  # values change, the shape does not
    assert set(save(2)) == {"w", "d", "step"} and len(made) == 1
    state["w"].requires_grad_(True)
    assert save(3)["w"].properties.requires_grad and len(made) == 2
    state["extra"] = torch.ones(5)
    assert save(4)["extra"].size == torch.Size([5]) and len(made) == 3
    state["d"] = distribute_tensor(torch.ones(6, 2), mesh, [Shard(0)])
    assert save(5)["d"].size == torch.Size([6, 2]) and len(made) == 4
    assert planning._shape({"t": torch.nn.Parameter(torch.ones(1))}, True) is not None
    assert planning._shape({"odd": torch.ones(2).as_subclass(type("Sub", (torch.Tensor,), {}))}, True) is None
