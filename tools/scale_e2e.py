"""A whole save at N ranks in one process: both states' planning, the optimizer's ``.metadata``, the failure
flags, the manifest, the commit and the object-store requests, the coordinator's part of each timed.

Used by ``bench_scale.py --simulate-ranks ... --end-to-end``. A synchronous save of a model (per-rank safetensors
shards) and its AdamW state (``.distcp``), as ``SaveWriter`` makes it, step by step, with every rank's part made
here through the product's own code and rank 0's part timed (CPU seconds):

* ``plan_s``: both DCP saves' planning (``scale_sim``'s local plans; the optimizer's moments sharded as their
  parameters, its step counts and hyperparameters held by every rank), through ``LinearSavePlanner``: every rank's
  plan unpickled, the global plan, the replies pickled, every rank's write results unpickled.
* ``metadata_s``: the optimizer folder's ``.metadata`` written by the product's storage writer (``finish``: the
  write results expanded, the metadata pickled, written and fsynced; ``fastio.metafile``); ``metadata_wall_s``
  its wall time (a large file is written past the page cache: the disk's time, not the CPU's).
* ``broadcast_s``: the metadata object each DCP save's write step broadcasts to every rank once its ``finish``
  is done (``plan_results.hollow``), pickled as ``broadcast_object_list`` pickles it (``broadcast_bytes``).
* ``flags_s``: the failure flags every ``collectively`` step all-gathers (three a save: the small files, the
  fsync, the checksums), unpickled as ``all_gather_object`` unpickles them.
* ``manifest_s``: ``manifest.seal``'s rank 0 part on a staging folder holding every rank's files (sparse, of the
  layout's sizes): the listing and shares, the shares scattered (pickled), its own checksums, every rank's
  checksums gathered (unpickled), merged, the manifest built and written.
* ``commit_s``: the publish (rename, ``LATEST``).
* ``object_store_requests``: the requests a save to an object store makes (``store_requests``).
* ``bytes_to_rank0``: what rank 0 receives: plans, write results, flags, checksums.

At more than 64 ranks a simulated rank other than 0 keeps only what the next save needs of it (its fingerprints
and digests) instead of its final plans: what it sends is the same, the coordinator's work is the real one.

Times internals: ``ondisk.saveplan``, ``ondisk.fastio``, ``ondisk.manifest``, ``ondisk.layout``, ``ondisk.checksum``, ``ondisk.durable``, ``checkpoint.storage``.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import io
import math
import pickle
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.filesystem import _StoragePrefix, _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

import scale_sim
import automodel_ckpt.checkpoint.storage.lifecycle as lifecycle
import automodel_ckpt.ondisk.layout as layout
import automodel_ckpt.ondisk.manifest as manifest
from automodel_ckpt.ondisk.checksum import default_algorithm
from automodel_ckpt.ondisk.durable import WrittenFiles
from automodel_ckpt.ondisk.fastio import ParallelFileSystemWriter
from automodel_ckpt.ondisk.fastio.common import compact
from automodel_ckpt.ondisk.fastio.filewrite import piece_length
from automodel_ckpt.ondisk.fastio.records import note_location, torch_save_bytes, torch_save_pieces
from automodel_ckpt.ondisk.saveplan import plan_results, planning
from automodel_ckpt.ondisk.saveplan.plan_results import ResultsNote
from automodel_ckpt.ondisk.saveplan.planning import LinearSavePlanner, PlanNote

FLAG_STEPS = 3  # ``collectively`` steps of a synchronous save: the small files, the fsync, the checksums
_PROPS = {dtype: TensorProperties(dtype=dtype, layout=torch.strided, requires_grad=False,
                                  memory_format=torch.contiguous_format, pin_memory=False)
          for dtype in (torch.float32, torch.bfloat16)}


# ------------------------------------------------------------------------------------------ the optimizer's plan
@functools.cache
def _param_group(name: str) -> tuple[tuple[str, Any], ...]:
    """AdamW's hyperparameters as ``get_optimizer_state_dict`` saves them (lr 1e-3, its defaults), ``params``
    last: the parameters' names."""
    group = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3).param_groups[0]
    return (*((k, v) for k, v in group.items() if k != "params"), ("params", [f for f, _ in scale_sim.params(name)]))


@functools.cache
def optim_items(name: str) -> tuple[tuple[str, str, Any, str | None], ...]:
    """The optimizer state's flattened entries in DCP's order: ``(key, kind, shape or value, parameter)``; a
    ``moment`` is sharded as its parameter, a ``step`` count (a 0-dim tensor) and each hyperparameter (``bytes``)
    are held by every rank."""
    out: list[tuple[str, str, Any, str | None]] = []
    for fqn, shape in scale_sim.params(name):
        out += [(f"state.{fqn}.step", "step", (), None), (f"state.{fqn}.exp_avg", "moment", shape, fqn),
                (f"state.{fqn}.exp_avg_sq", "moment", shape, fqn)]
    return tuple(out) + tuple((f"param_groups.0.{k}", "bytes", v, None) for k, v in _param_group(name))


@functools.cache
def optim_mappings(name: str) -> dict[str, tuple]:
    """DCP's key mapping of that state (``flatten_state_dict`` of the same structure)."""
    state = {"state": {fqn: {"step": 0, "exp_avg": 0, "exp_avg_sq": 0} for fqn, _ in scale_sim.params(name)},
             "param_groups": [dict(_param_group(name))]}
    return flatten_state_dict(state)[1]


def optim_local_plan(name: str, strategy: str, n: int, rank: int) -> SavePlan:
    """What ``create_default_local_save_plan`` makes on ``rank`` for the optimizer state."""
    props, items = _PROPS[torch.float32], []
    for key, kind, shape, param in optim_items(name):
        if kind == "bytes":  # a hyperparameter
            items.append(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO))
            continue
        if kind == "step":  # a step count: a plain tensor, every rank's
            at = torch.Size(())
            items.append(WriteItem(index=MetadataIndex(key, at), type=WriteItemType.TENSOR, tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=at, sizes=at), properties=props, size=at)))
            continue
        sizes, offsets = scale_sim._chunks(strategy, scale_sim._kind(param), shape, n)[rank]
        offsets, sizes = torch.Size(offsets), torch.Size(sizes)
        items.append(WriteItem(index=MetadataIndex(key, offsets), type=WriteItemType.SHARD, tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes), properties=props, size=torch.Size(shape))))
    return SavePlan(items)


@functools.cache
def _record(sizes: tuple[int, ...], dtype: torch.dtype) -> tuple[int, dict[str, Any]]:
    """The length of a tensor's ``.distcp`` record as the product's writer writes it, and the location note it
    sets on the record's storage info (``records.note_location``)."""
    tensor = torch.zeros(sizes, dtype=dtype)
    record = torch_save_pieces(tensor) or [torch_save_bytes(compact(tensor))]
    info = note_location(_StorageInfo("", 0, 0), record)
    return sum(piece_length(p) for p in record), {k: v for k, v in vars(info).items()
                                                  if k not in ("relative_path", "offset", "length")}


@functools.cache
def _bytes_length(name: str, key: str) -> int:
    """The length of a hyperparameter's record: ``torch.save`` of its value (DCP's ``resolve_data``)."""
    buffer = io.BytesIO()
    torch.save(next(v for k, _, v, _ in optim_items(name) if k == key), buffer)
    return len(buffer.getvalue())


def optim_results(name: str, plan: SavePlan, rank: int) -> list[WriteResult]:
    """What ``ParallelFileSystemWriter.write_data`` returns on ``rank`` for its final ``plan``: the bytes items
    first, one ``__<rank>_0.distcp`` file."""
    file = f"__{rank}_0.distcp"
    items = [wi for wi in plan.items if wi.type == WriteItemType.BYTE_IO]
    items += [wi for wi in plan.items if wi.type != WriteItemType.BYTE_IO]
    out, at = [], 0
    for wi in items:
        info = _StorageInfo(file, at, 0)
        if wi.type == WriteItemType.BYTE_IO:
            info.length = _bytes_length(name, wi.index.fqn)
        else:
            info.length, extra = _record(tuple(wi.tensor_data.chunk.sizes), wi.tensor_data.properties.dtype)
            for k, v in extra.items():
                setattr(info, k, v)
        out.append(WriteResult(index=wi.index, size_in_bytes=info.length, storage_data=info))
        at += info.length
    return out


# ------------------------------------------------------------------------------------------ one DCP save
_SIZES: dict[tuple[str, int], list[int]] = {}  # (key, ranks) -> each rank's file size in the last save


@dataclasses.dataclass
class Saved:
    seconds: float  # the coordinator's planning
    metadata: Any
    finals: list | None  # every rank's final plan (64 ranks or fewer)
    notes: list[bytes]  # every rank's write results as sent
    plan_bytes: int  # what rank 0 received: plans and write results
    reused: bool
    sizes: list[int]  # each rank's file size


def dcp_save(plan_of: Callable[[int], SavePlan], mappings: Any, n: int, key: str, *, needed: bool,
             storage: Callable[[int], Any], results_of: Callable[[SavePlan, int], list[WriteResult]]) -> Saved:
    """One ``dcp.save``'s coordination at ``n`` ranks (see ``scale_sim.save``): every rank's plan through its own
    ``LinearSavePlanner``, rank 0's part timed. ``storage(i)``: the storage writer's global step for rank ``i``;
    ``needed``: whether the writer's ``finish`` reads the write results (sent as ``plan_results`` sends them)."""
    light = n > 64
    sent, planners = [], []
    gc.disable()
    for rank in range(n):
        planner = LinearSavePlanner(key, world_size=n, rank=rank)
        planner.mappings, planner.is_coordinator = mappings, rank == 0
        again = light and rank and (key, n, rank) in planning._RANK_CACHE
        if again and rank > 1:
            sent.append(_unchanged(planner, key, n, rank))
        else:
            shortcut = _unchanged(LinearSavePlanner(key, world_size=n, rank=rank), key, n, rank, check=True) \
                if again else None
            sent.append(pickle.dumps(planner.outgoing(plan_of(rank))))
            assert shortcut in (None, sent[-1]), "a light rank's unchanged plan sends its fingerprint alone"
        planner.plan = None
        if light and rank:
            planner._local = None  # made again for its final plan: the simulation holds one rank's items at a time
        planners.append(planner)
    gc.freeze()
    gc.enable()
    t0 = time.process_time()
    with planning.coordinating(n, 0):  # as sharded._save runs the coordinator's whole save
        replies, metadata = planners[0].create_global_plan([pickle.loads(b) for b in sent])
        scattered = [pickle.dumps(dataclasses.replace(p, storage_data=storage(i))) for i, p in enumerate(replies)]
    seconds = time.process_time() - t0
    finals, notes, sizes = [], [], []
    gc.disable()
    for rank in range(n):
        planner = planners[rank]
        reply = pickle.loads(scattered[rank])
        if planner._local is None and reply.usable:
            planner._local = SavePlan(plan_of(rank).items, planner_data=mappings)
        final = planner.finish_plan(reply)
        results = results_of(final, rank) if final is not None else None
        if results is not None:
            sizes.append(sum(r.size_in_bytes for r in results))
            note = plan_results.outgoing(results, key, n, rank) if needed else ResultsNote("")
        else:  # a light rank's next save: unchanged results, as ``outgoing`` sends them
            sizes.append(_SIZES[(key, n)][rank])
            note = ResultsNote(plan_results._RANK.pop((key, n, rank))) if needed else ResultsNote("")
        notes.append(pickle.dumps(note))
        plan_results.succeeded(key, n, rank, note)
        if light and rank:
            planners[rank] = planner = None
            entry = planning._RANK_CACHE.get((key, n, rank))
            if entry is not None:
                entry.final_plan = None  # the next save's reply tells it to reuse; its results are known
        elif n <= 64:
            finals.append(final)
    gc.freeze()
    gc.enable()
    gc.unfreeze()
    _SIZES[(key, n)] = sizes
    return Saved(seconds, metadata, finals if n <= 64 else None, notes,
                 sum(map(len, sent)) + sum(map(len, notes)), planners[0].reused, sizes)


def _unchanged(planner: LinearSavePlanner, key: str, n: int, rank: int, check: bool = False) -> bytes:
    """What ``outgoing`` sends for a rank's plan unchanged since its last save (its fingerprint alone), without
    making the plan again: a light rank's next save. ``check``: rank 1's, made both ways, must be equal."""
    cached = planning._RANK_CACHE.get((key, n, rank)) if check else planning._RANK_CACHE.pop((key, n, rank))
    planner._fingerprint, planner._cached = cached.fingerprint, cached
    planner.plan = SavePlan([], planner_data=PlanNote(cached.fingerprint), usable=False)
    return pickle.dumps(planner.plan)


# ------------------------------------------------------------------------------------------ the whole save
def _flags(n: int) -> tuple[float, int]:
    """One ``collectively`` step's failure flags on rank 0: every rank's ``None``, as ``all_gather_object`` sends
    it (pickled, padded to the largest), unpickled; returns the seconds and the bytes received."""
    flag = pickle.dumps(None)
    received = [flag] * n
    t0 = time.process_time()
    for data in received:
        pickle.loads(data)
    return time.process_time() - t0, n * len(flag)


def store_requests(files: dict[str, int], n: int) -> int:
    """The requests a save to an object store makes (``objectstore.run``): each rank's share (``manifest.assign``)
    uploaded, a file over 100 MiB in 50 MiB parts (create, parts, complete: ``store``'s multipart), one PUT
    otherwise; rank 0 before the save (does the checkpoint exist, the listing, the upload marker) and at the
    commit (the manifest, the logs, the three pointers)."""
    part, large = 50 << 20, 100 << 20
    per_file = sum(1 if size <= large else 2 + math.ceil(size / part) for size in files.values())
    return per_file + 3 + 1 + 1 + 3


def save(name: str, strategy: str, n: int, root: Path, step: int) -> dict[str, Any]:
    """One whole save of the layout at ``n`` ranks into run folder ``root`` as checkpoint ``step_<step>``."""
    ckpt = f"step_{step}"
    staging = lifecycle.reserve(root, ckpt)
    model_key = f"{root}/{layout.MODEL_DIR}:ParallelSafetensorsWriter"  # sharded.cache_key
    optim_dir = staging / "optim"
    optim_key = f"{root}/optim:ParallelFileSystemWriter"
    for sub in (layout.MODEL_DIR, "optim", "rng"):
        (staging / sub).mkdir()
    model = dcp_save(lambda r: scale_sim.local_plan(name, strategy, n, r), scale_sim.mappings(name), n,
                     model_key, needed=False, storage=lambda i: {"shard_index": i + 1},
                     results_of=lambda plan, r: scale_sim._write_results(plan, r, n))
    optim = dcp_save(lambda r: optim_local_plan(name, strategy, n, r), optim_mappings(name), n, optim_key,
                     needed=True, storage=lambda i: _StoragePrefix(f"__{i}_"),
                     results_of=lambda plan, r: optim_results(name, plan, r))
    written, algorithm = WrittenFiles(), default_algorithm()  # as the checkpointer's: what its writers noted
    writer = ParallelFileSystemWriter(optim_dir, written=written)
    writer.reset(optim_dir)
    writer.set_up_storage_writer(True)
    plan_results.keep_results(writer, optim_key, n, 0)
    given = [model.metadata, optim.metadata]  # the objects each save's finish is given, then DCP broadcasts
    model.metadata, optim.metadata = (dataclasses.replace(m) for m in given)  # as planned, for --dump-plans
    t0, wall = time.process_time(), time.perf_counter()
    with planning.coordinating(n, 0):
        writer.finish(given[1], [pickle.loads(b) for b in optim.notes])
    metadata_s, metadata_wall_s = time.process_time() - t0, time.perf_counter() - wall
    plan_results.hollow(given[0])  # the model's finish (per-rank safetensors shards: nothing more to write)
    broadcast_s, broadcast_bytes = 0.0, 0
    for metadata in given:  # the write step's all_reduce: the coordinator pickles, every rank unpickles
        t0 = time.process_time()
        data = pickle.dumps(metadata)
        broadcast_s += time.process_time() - t0
        broadcast_bytes += len(data)
    flags_s, flag_bytes = 0.0, 0
    for _ in range(FLAG_STEPS):
        s, b = _flags(n)
        flags_s, flag_bytes = flags_s + s, flag_bytes + b

    # every rank's files, of the layout's sizes (sparse); the data files' checksums noted as their writers note them
    for rank in range(n):
        for rel, size in ((f"{layout.MODEL_DIR}/{scale_sim.model_shard_file(rank, rank + 1, n)}", model.sizes[rank]),
                          (f"optim/__{rank}_0.distcp", optim.sizes[rank]), (f"rng/rng_dp_rank_{rank}.pt", 1400)):
            with open(staging / rel, "wb") as f:
                f.truncate(size)
            written.note(staging / rel, synced=True, algorithm=algorithm, digest=f"{(rank * 7919 + size) & 0xffffffffffffffff:016x}")
    for rel, text in ((layout.CONFIG_FILE, "bench: scale\n"), (layout.LOSSES_FILE, '{"step": %d}\n' % step),
                      (layout.METADATA_FILE, '{"step": %d, "world_size": %d}\n' % (step, n))):
        (staging / rel).write_text(text)
    manifest_s, checksum_bytes = seal(staging, n, written)
    t0 = time.process_time()
    lifecycle.publish(root, ckpt, update_lowest_val=False)
    commit_s = time.process_time() - t0
    files = manifest.list_files(root / ckpt)
    return {"plan_s": model.seconds + optim.seconds, "metadata_s": metadata_s, "broadcast_s": broadcast_s,
            "flags_s": flags_s, "manifest_s": manifest_s, "commit_s": commit_s, "metadata_wall_s": metadata_wall_s,
            "total_s": model.seconds + optim.seconds + metadata_s + broadcast_s + flags_s + manifest_s + commit_s,
            "object_store_requests": store_requests(files, n),
            "bytes_to_rank0": model.plan_bytes + optim.plan_bytes + flag_bytes + checksum_bytes,
            "broadcast_bytes": broadcast_bytes,
            "reused": model.reused and optim.reused, "model": model, "optim": optim, "folder": root / ckpt}


def seal(staging: Path, n: int, written: WrittenFiles) -> tuple[float, int]:
    """``manifest.seal`` at ``n`` ranks: rank 0's part timed; returns its seconds and the checksum bytes it
    received."""
    t0 = time.process_time()
    files, linked = manifest.list_files_and_linked(staging)  # on_main: the listing and the shares
    shares = manifest.assign(files, n)
    scattered = [pickle.dumps({rel: files[rel] for rel in rels}) for rels in shares]
    mine = manifest._hash_share(staging, shares[0], files, default_algorithm(), written)
    seconds = time.process_time() - t0
    sent = [pickle.dumps(mine)]
    for rank in range(1, n):  # every other rank: its share received, hashed (its writers' checksums), sent
        share = pickle.loads(scattered[rank])
        sent.append(pickle.dumps(manifest._hash_share(staging, list(share), share, default_algorithm(), written)))
    t0 = time.process_time()
    parts = [pickle.loads(b) for b in sent]  # gathered
    manifest.write(staging, manifest.build_manifest(staging, files, manifest.merge_checksums(parts), default_algorithm(),
                                           linked=linked))
    return seconds + time.process_time() - t0, sum(map(len, sent))
