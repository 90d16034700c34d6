"""Checkpoint coordination at N ranks in one process: the coordinator's work of a save and a load, timed.

Used by ``bench_scale.py --simulate-ranks``. Every rank's local save plan is what DCP's
``create_default_local_save_plan`` makes for a DTensor of that rank (``_create_write_items_for_dtensor``: offsets
and sizes from DTensor's own ``_compute_local_shape_and_global_offset`` for the rank's mesh coordinate), plus the
state's key mapping, sent through ``LinearSavePlanner.create_local_plan`` as a rank would. What the coordinator
receives is pickled as ``gather_object`` pickles it; the coordinator's CPU time covers unpickling every rank's
plan, the global plan and metadata (``LinearSavePlanner``), the storage writer's global step, pickling the plans
it scatters back, unpickling every rank's write results, the manifest's checksum gather and merge. A load times
the coordinator's own local load plan (``LocalLoadPlanner``'s read items for its chunks, DCP's own), unpickling
every rank's load plan and scattering them back (DCP's global load plan returns them unchanged).

Times internals: imports ``ondisk.saveplan``, ``ondisk.manifest`` and ``ondisk.layout`` directly.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import hashlib
import pickle
import time
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.default_planner import create_default_global_load_plan
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

from automodel_ckpt.ondisk import CheckpointFolder
from automodel_ckpt.ondisk.saveplan.plan_results import ResultsNote
from automodel_ckpt.ondisk.saveplan.plan_results import incoming as incoming_results
from automodel_ckpt.ondisk.saveplan.plan_results import outgoing as outgoing_results
from automodel_ckpt.ondisk.saveplan.plan_results import succeeded as results_succeeded
from automodel_ckpt.ondisk.saveplan.planning import LinearSavePlanner, LocalLoadPlanner, read_items_for_chunks
from automodel_ckpt.ondisk.layout import model_shard_file
from automodel_ckpt.ondisk.manifest import build_manifest, dump_manifest
from automodel_ckpt.ondisk.manifest import merge_checksums

TP = 8  # ranks per node: the shard group of HSDP, the tensor-parallel group of tp-fsdp

# (vocab, hidden, intermediate, layers, kv width, experts)
_MODELS = {"llama3-70b": (128256, 8192, 28672, 80, 1024, 0), "llama3-8b": (128256, 4096, 14336, 32, 1024, 0),
           "moe": (32000, 4096, 14336, 32, 1024, 8)}


def params(name: str) -> list[tuple[str, tuple[int, ...]]]:
    """The parameters of a layout, in a model's state-dict order: Llama-3 70B (722 tensors) and 8B (291), a
    Mixtral-8x7B-shaped MoE (8 experts a layer, 995), or ``tiny`` (the real-process benchmark's model)."""
    if name == "tiny":
        return [p for i in range(4) for p in ((f"{i}.weight", (16, 16)), (f"{i}.bias", (16,)))]
    vocab, h, inter, layers, kv, experts = _MODELS[name]
    out = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(layers):
        pre = f"model.layers.{i}."
        out += [(pre + "self_attn.q_proj.weight", (h, h)), (pre + "self_attn.k_proj.weight", (kv, h)),
                (pre + "self_attn.v_proj.weight", (kv, h)), (pre + "self_attn.o_proj.weight", (h, h))]
        if experts:
            out.append((pre + "block_sparse_moe.gate.weight", (experts, h)))
            for e in range(experts):
                ex = f"{pre}block_sparse_moe.experts.{e}."
                out += [(ex + "w1.weight", (inter, h)), (ex + "w2.weight", (h, inter)), (ex + "w3.weight", (inter, h))]
        else:
            out += [(pre + "mlp.gate_proj.weight", (inter, h)), (pre + "mlp.up_proj.weight", (inter, h)),
                    (pre + "mlp.down_proj.weight", (h, inter))]
        out += [(pre + "input_layernorm.weight", (h,)), (pre + "post_attention_layernorm.weight", (h,))]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]


def _mesh(strategy: str, n: int) -> tuple[int, ...]:
    if strategy == "fsdp":
        return (n,)
    if n % TP:
        raise SystemExit(f"--strategy {strategy} needs a multiple of {TP} ranks, not {n}")
    return (n // TP, TP)


def _placements(strategy: str, fqn: str, ndim: int) -> tuple[Any, ...]:
    """FSDP2's placements: Shard(0) over every rank; HSDP: replicated across nodes, Shard(0) within one; TP then
    FSDP: column-parallel weights Shard(0) over TP (FSDP's dim-0 shard strided inside it), row-parallel Shard(1)."""
    if strategy == "fsdp":
        return (Shard(0),)
    if strategy == "hsdp":
        return (Replicate(), Shard(0))
    if ndim == 1 or fqn.endswith("gate.weight"):
        return (Shard(0), Replicate())
    if any(k in fqn for k in ("o_proj", "down_proj", "w2.")):
        return (Shard(0), Shard(1))
    return (_StridedShard(0, split_factor=TP), Shard(0))


@functools.cache
def _chunks(strategy: str, fqn_kind: str, shape: tuple[int, ...], n: int) -> list[tuple[tuple[int, ...], ...]]:
    """(sizes, offsets) of every rank's piece of a tensor (DTensor's own arithmetic; FSDP's dim-0 shard strided
    inside TP's in closed form, checked against DTensor's at every 61st rank and the last)."""
    mesh = _mesh(strategy, n)
    placements = _placements(strategy, fqn_kind, len(shape))

    def dtensor(rank: int) -> tuple[tuple[int, ...], ...]:
        coord = [rank] if len(mesh) == 1 else [rank // mesh[1], rank % mesh[1]]
        sizes, offsets = _compute_local_shape_and_global_offset(shape, mesh, coord, placements)
        return tuple(sizes), tuple(offsets)

    if not isinstance(placements[0], _StridedShard):
        return [dtensor(rank) for rank in range(n)]
    out = [_strided(shape, mesh, rank) for rank in range(n)]
    for rank in [*range(0, n, 61), n - 1]:  # DTensor's _StridedShard splits an arange of the dim at every call
        assert out[rank] == dtensor(rank), f"closed form of the strided shard at rank {rank} of {n}: {shape}"
    return out


def _strided(shape: tuple[int, ...], mesh: tuple[int, ...], rank: int) -> tuple[tuple[int, ...], ...]:
    """(_StridedShard(0, split_factor=TP) over mesh dim 0, Shard(0) over dim 1): dim 0 cut in ``mesh[1]`` chunks
    (``torch.chunk``'s sizes), the rank's TP chunk cut again in ``mesh[0]``; the other dims whole."""
    dp, tp = mesh
    i, j = rank // tp, rank % tp
    step = -(-shape[0] // tp)
    start = min(j * step, shape[0])
    length = max(0, min((j + 1) * step, shape[0]) - start)
    inner = -(-length // dp)
    lo, hi = min(i * inner, length), min((i + 1) * inner, length)
    return (hi - lo, *shape[1:]), (start + lo if hi > lo else shape[0], *(0 for _ in shape[1:]))  # empty: the end


def _kind(fqn: str) -> str:
    """The part of a name that decides its placements (so that the chunks of every layer are computed once)."""
    return fqn.rsplit(".", 2)[-2] + "." + fqn.rsplit(".", 1)[-1] if "." in fqn else fqn


def local_plan(name: str, strategy: str, n: int, rank: int, dtype: torch.dtype = torch.float32) -> SavePlan:
    """What ``create_default_local_save_plan`` makes on ``rank`` for the layout's DTensors, with the key mapping."""
    items = []
    for fqn, shape in params(name):
        sizes, offsets = _chunks(strategy, _kind(fqn), shape, n)[rank]
        offsets, sizes = torch.Size(offsets), torch.Size(sizes)
        props = TensorProperties(dtype=dtype, layout=torch.strided, requires_grad=False,
                                 memory_format=torch.contiguous_format, pin_memory=False)
        items.append(WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                               tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                                                           properties=props, size=torch.Size(shape))))
    return SavePlan(items)


def mappings(name: str) -> dict[str, tuple[str, ...]]:
    return {fqn: (fqn,) for fqn, _ in params(name)}


def rank_local_plan(name: str, strategy: str, n: int, rank: int, key: str = "model"
                    ) -> tuple[bytes, LinearSavePlanner]:
    """The pickled plan rank ``rank`` sends the coordinator (its planner's cache consulted, as in a real save),
    and its planner."""
    planner = LinearSavePlanner(key, world_size=n, rank=rank)
    planner.mappings, planner.is_coordinator = mappings(name), rank == 0
    return pickle.dumps(planner.outgoing(local_plan(name, strategy, n, rank))), planner


def _write_results(plan: SavePlan, rank: int, n: int) -> list[WriteResult]:
    """What a rank's storage writer returns for its final plan (one safetensors shard per rank)."""
    file = model_shard_file(rank, rank + 1, n)
    out, at = [], 0
    for wi in plan.items:
        length = 4 * int(torch.Size(wi.tensor_data.chunk.sizes).numel()) if wi.tensor_data else 8
        out.append(WriteResult(index=wi.index, size_in_bytes=length, storage_data=_StorageInfo(file, at, length)))
        at += length
    return out


def save(name: str, strategy: str, n: int, key: str = "model", results_needed: bool = False) -> dict[str, Any]:
    """One save's coordination at ``n`` ranks: returns the coordinator's seconds, the global plan and metadata,
    and the bytes each rank sent the coordinator (the largest)."""
    sent, planners = [], []
    gc.disable()  # the simulation's own millions of objects (untimed): no collection walks them
    for rank in range(n):  # every rank's own work, in parallel in a real job: not the coordinator's
        data, planner = rank_local_plan(name, strategy, n, rank, key)
        planner.plan = None  # sent: only what the rank keeps stays
        sent.append(data)
        planners.append(planner)
    gc.freeze()
    gc.enable()  # the other simulated ranks' objects: a real coordinator holds none, its collector walks none
    t0 = time.process_time()
    coordinator = planners[0]
    received = [pickle.loads(b) for b in sent]
    replies, metadata = coordinator.create_global_plan(received)
    replies = [dataclasses.replace(p, storage_data={"shard_index": i})  # the safetensors writer's global step
               for i, p in enumerate(replies, start=1)]
    scattered = [pickle.dumps(p) for p in replies]
    seconds = time.process_time() - t0
    finals, results_sent, notes = [], [], []
    gc.disable()
    for rank, planner in enumerate(planners):  # every rank: its final plan, its write results
        finals.append(planner.finish_plan(pickle.loads(scattered[rank])))
        results = _write_results(finals[-1], rank, n)  # the safetensors shards' finish reads none: none is sent
        notes.append(ResultsNote("") if not results_needed else
                     outgoing_results(results, key, n, rank))
        results_sent.append(pickle.dumps(notes[-1]))
    gc.freeze()
    gc.enable()
    t0 = time.process_time()  # the safetensors shards' finish reads no results: not rebuilt
    results = incoming_results([pickle.loads(b) for b in results_sent], key, needed=results_needed)
    seconds += time.process_time() - t0
    for rank, note in enumerate(notes):
        results_succeeded(key, n, rank, note)
    gc.unfreeze()
    checksum_bytes, merge_seconds = _manifest(n)
    per_rank = max(len(a) + len(b) for a, b in zip(sent, results_sent)) + checksum_bytes
    return {"seconds": seconds + merge_seconds, "final_plans": finals if n <= 64 else None, "metadata": metadata,
            "reused": coordinator.reused, "object_bytes_per_rank": per_rank, "results": results}


def _manifest(n: int) -> tuple[int, float]:
    """The manifest's checksum gather and merge: each rank's share (its shard and its rank state), pickled as a
    gather sends it; rank 0 merges them and writes the manifest's text."""
    shares = []
    for rank in range(n):
        files = {f"{CheckpointFolder.model}/{model_shard_file(rank, rank + 1, n)}": hashlib.sha256(b"%d" % rank).hexdigest(),
                 f"rng/rng_dp_rank_{rank}.pt": hashlib.sha256(b"r%d" % rank).hexdigest()}
        shares.append(pickle.dumps(files))
    t0 = time.process_time()
    checksums = merge_checksums(pickle.loads(b) for b in shares)
    sizes = dict.fromkeys(checksums, 1 << 30)
    dump_manifest(build_manifest(None, sizes, checksums, "sha256"))
    return max(len(b) for b in shares), time.process_time() - t0


def load(name: str, strategy: str, saved: Any, n: int) -> float:
    """A load's coordination at ``n`` ranks from ``saved`` metadata: the coordinator's own local load plan
    (``planning.read_items_for_chunks``: DCP's read items, found in one pass over its tensor's saved chunks),
    and every rank's empty plan (``LocalLoadPlanner``: each keeps its own) gathered and scattered back."""
    md = saved.state_dict_metadata
    mesh, coord = _mesh(strategy, n), [0] * len(_mesh(strategy, n))
    mine = [(fqn, _compute_local_shape_and_global_offset(shape, mesh, coord, _placements(strategy, fqn, len(shape))))
            for fqn, shape in params(name)]  # rank 0's own pieces: the simulation's arithmetic, not timed
    t0 = time.process_time()
    requests = []
    for fqn, (sizes, offsets) in mine:
        requests += read_items_for_chunks(
            fqn, md[fqn], [ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))])
    sent = pickle.dumps(LoadPlan([], planner_data=LocalLoadPlanner._LOCAL))
    for plan in create_default_global_load_plan([pickle.loads(sent) for _ in range(n)]):
        pickle.dumps(plan)  # scattered back
    return time.process_time() - t0
