"""Sharded model and optimizer state through torch.distributed.checkpoint, in the files of a format's storage.

``ShardsFormat``s name their storage writer and reader; optimizer state is always ``.distcp`` files (``DCP_FILES``)."""

from __future__ import annotations

import copy
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.optim import Optimizer

from automodel_ckpt.ondisk import fastio
from automodel_ckpt.ondisk.fastio import session
from automodel_ckpt.ondisk.formats import replicated, state_dicts
from automodel_ckpt.ondisk.saveplan import plan_results, planning
from automodel_ckpt.ondisk.durable import WrittenFiles
from automodel_ckpt.ondisk.incremental import Reuse
from automodel_ckpt.ondisk.loadcheck import DamagedFile, LoadCheck
from automodel_ckpt.ondisk.formats.base import ModelFormat
from automodel_ckpt.ondisk.formats.safe_load import check_fits, load_failure, root_cause, save_failure


def _writer(path: Path, fmt: Any, written: WrittenFiles | None = None, *, threads: int | None = None,
            small_apart: bool = False, incremental: Incremental | None = None):
    """The storage writer of ``fmt`` (a ``ShardsFormat``, or ``DCP_FILES``): parallel, each file fsynced once and
    its checksum noted in ``written``. ``small_apart``: DCP's small items in a file of their own; ``incremental``:
    stable tensors in files of their own, hard-linked from the previous checkpoint when unchanged."""
    extra: dict[str, Any] = {} if threads is None else {"threads": threads}
    if incremental is not None:
        extra |= {"stable": incremental.stable, "reuse": incremental.reuse}
    return fmt.storage_writer(path, written, small_apart=small_apart, **extra)


def _reader(path: Path, fmt: Any, check: LoadCheck | None = None):
    """The storage reader of ``fmt`` (``check``: checksums computed as the files are read)."""
    return fmt.storage_reader(path, check)


class DcpFiles:
    """DCP's ``.distcp`` files (``__R_0``, and ``__R_1`` with ``small_apart``): always the optimizer's format."""

    def storage_writer(self, path: Path, written: WrittenFiles | None, *, small_apart: bool = False, **extra: Any):
        return fastio.ParallelFileSystemWriter(path, written=written, small_apart=small_apart, **extra)

    def storage_reader(self, path: Path, check: LoadCheck | None = None):
        return fastio.ParallelFileSystemReader(path, check=check)


DCP_FILES = DcpFiles()


class ShardsFormat(ModelFormat):
    """A model format every rank writes and reads through DCP: subclasses give ``storage_writer``/``storage_reader``."""

    def writer(self, *, rank: int, reuse: Reuse | None = None, hf: Any = None) -> ModelShards:
        return ModelShards(self, reuse)

    def load(self, model: nn.Module, folder: Path, check: LoadCheck | None = None) -> None:
        load_model(model, folder, self, check=check)


def cache_key(path: Path, writer: Any) -> str:
    """The plan caches' key of a save into ``<root>/<staging folder>/<state folder>``: the root and the state
    folder. Each root has its own: a node-local save may overlap a durable save of the same state."""
    return f"{path.parent.parent}/{path.name}:{type(writer).__name__}"


def _save(state: dict, path: Path, writer, process_group) -> None:
    """``dcp.save`` with plans and write results cached per state folder and writer (``planning``, ``plan_results``)."""
    import torch.distributed as dist

    world, rank = (dist.get_world_size(process_group), dist.get_rank(process_group)) if dist.is_initialized() else (1, 0)
    key = cache_key(path, writer)
    succeeded = plan_results.keep_results(writer, key, world, rank)
    try:
        with planning.coordinating(world, rank):  # a large save's coordinator: the collector paused
            dcp.save(state, storage_writer=writer,
                     planner=planning.LinearSavePlanner(key, world_size=world, rank=rank), process_group=process_group)
    except CheckpointException as exc:  # raised on every rank; one line naming the folder (disk full, ...)
        raise save_failure(exc, path) from None
    succeeded()


def _load(state: dict, path: Path, reader, process_group, *, strict_keys: bool) -> None:
    """``dcp.load`` that first checks keys and shapes (``strict_keys``: extra checkpoint keys count too)."""
    metadata = reader.read_metadata()
    if strict_keys:
        check_fits(state, metadata, path, held=_held_by_any_rank(state, process_group))
    try:
        dcp.load(state, storage_reader=reader, planner=planning.LocalLoadPlanner(path), process_group=process_group)
    except CheckpointException as exc:
        cause = root_cause(exc)
        if isinstance(cause, DamagedFile):  # on every rank: the checkpoint is damaged, not the state unfit
            raise DamagedFile(str(cause)) from None
        raise load_failure(exc, path, state, metadata) from None


def _held_by_any_rank(state: dict, process_group) -> set[str]:
    """The keys of ``state`` on every rank together (pipeline stages each hold their own part of the model)."""
    import torch.distributed as dist

    keys = set(state)
    if not dist.is_initialized() or dist.get_world_size(process_group) == 1:
        return keys
    every: list[Any] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(every, sorted(keys), group=process_group)
    return keys.union(*every)


class Incremental:
    """A model's stable tensors (those that do not train: ``stable(fqn)``) and the ``Reuse`` that writes them."""

    def __init__(self, model: nn.Module, reuse: Reuse) -> None:
        self.trained = _trained_names(model)
        self.reuse = reuse

    def stable(self, fqn: str) -> bool:
        return fqn not in self.trained


def _trained_names(model: nn.Module) -> frozenset[str]:
    """The state-dict names of the parameters that train (a name missed here only costs a write)."""
    from automodel_ckpt.distributed.dcp_private import get_fqns

    names: set[str] = set()
    try:
        for name, param in model.named_parameters():
            if param.requires_grad:
                names |= set(get_fqns(model, name))
    except ImportError:  # torch's helper moved: the names as they are
        return frozenset(n for n, p in model.named_parameters() if p.requires_grad)
    return frozenset(names)


def save_model(model: nn.Module, path: Path, fmt: ShardsFormat, process_group=None, written: WrittenFiles | None = None,
               reuse: Reuse | None = None) -> None:
    incremental = Incremental(model, reuse) if reuse is not None else None
    _save(_model_state(model), path, _writer(path, fmt, written, incremental=incremental), process_group)


def _model_state(model: nn.Module) -> dict:
    """The model's state as it is saved: a replicated model's parameters as FSDP2's shards (``replicated``)."""
    return replicated.model_shards(model)(get_model_state_dict(model))


def _optimizer_state(model: nn.Module, optimizer: Optimizer) -> dict:
    """The optimizer's state as it is saved: a replicated model's moments as FSDP2's shards (``replicated``)."""
    return replicated.optimizer_shards(model)(get_optimizer_state_dict(model, optimizer))


def reading():
    """A context in which loads share reader threads and read buffers (``fastio.session``)."""
    return session.kept()


def load_model(model: nn.Module, path: Path, fmt: ShardsFormat, process_group=None, check: LoadCheck | None = None) -> None:
    """Load into the model's current sharding (which may differ from the one that saved it)."""
    state = get_model_state_dict(model)
    _load(state, path, _reader(path, fmt, check), process_group, strict_keys=True)
    if not _loaded_in_place(model, state):
        set_model_state_dict(model, state)


def _loaded_in_place(model: nn.Module, state: dict) -> bool:
    """Whether the load wrote every value into the model's own memory (``set_model_state_dict`` would copy nothing)."""
    current = get_model_state_dict(model)
    return current.keys() == state.keys() and all(
        isinstance(value, torch.Tensor) and state_dicts.same_value(value, current[key]) for key, value in state.items())


def save_optimizer(model: nn.Module, optimizer: Optimizer, path: Path, process_group=None,
                   written: WrittenFiles | None = None) -> None:
    _save(_optimizer_state(model, optimizer), path, _writer(path, DCP_FILES, written), process_group)


class StagedSave:
    """A model or optimizer state for a background save, made on the training thread from ``_freeze``'s state:
    ``capture`` copies the large tensors into the stager's host buffers (before the next optimizer step may run),
    ``write`` writes the copy through ``dcp.save``."""

    def __init__(self, key: str, state: dict, stager: HostStager, path: Path, fmt: Any,
                 written: WrittenFiles | None = None, threads: int | None = None, small_apart: bool = False,
                 incremental: Incremental | None = None, shards: Callable[[dict], dict] = replicated.unchanged) -> None:
        self.key = key
        self.state: dict | None = state
        self.shards: Callable[[dict], dict] | None = shards
        self.stager = stager
        self.staged: dict | None = None
        self.path = path
        self.fmt = fmt
        self.written = written
        self.threads = threads
        self.small_apart = small_apart
        self.incremental = incremental

    def capture(self) -> None:
        """Copy the live tensors; afterwards the training thread may change them."""
        assert self.state is not None, "captured twice"
        self.staged = self.stager.stage(self.key, self._laid_out())
        self.state = None  # no reference to the live tensors outlives the capture

    def _laid_out(self) -> dict:
        """``state`` in the layout it is saved in (``shards`` applied once)."""
        if self.shards is not None and self.state is not None:
            self.state, self.shards = self.shards(self.state), None
        return self.state

    def write(self, process_group) -> None:
        """Write the captured copy (collective on ``process_group``; raises on every rank if any rank fails)."""
        assert self.staged is not None, "write before capture"
        _save(self.staged, self.path, self._storage_writer(), process_group)

    def _storage_writer(self):
        return _writer(self.path, self.fmt, self.written, threads=self.threads, small_apart=self.small_apart,
                       incremental=self.incremental)

    def fail(self, error: BaseException, process_group) -> None:
        """This rank could not capture: take part in the write collectively, so that every rank raises ``error``."""
        writer = self._storage_writer()

        def refuse(plan, planner):
            raise error

        writer.prepare_local_plan = lambda plan: plan  # creates no folder: the staging one may not be reserved
        writer.write_data = refuse
        state = self.staged
        if state is None and self.state is not None:
            try:  # the plan every rank makes: the saved layout's (a failure here plans the state as it is)
                state = self._laid_out()
            except Exception:  # noqa: BLE001 - ``error`` is the one raised
                state = self.state
        _save(state or {}, self.path, writer, process_group)


def stage_model(model: nn.Module, path: Path, fmt: ShardsFormat, stager: HostStager, written: WrittenFiles | None = None,
                *, threads: int | None = None, reuse: Reuse | None = None) -> StagedSave:
    """The first half of a background ``save_model``: small tensors and buffers copied now, the parameters later."""
    buffers = {name for name, _ in model.named_buffers()}
    state = _freeze(state_dicts.model_state_dict(model), eager=lambda key: key in buffers)
    incremental = Incremental(model, reuse) if reuse is not None else None
    return StagedSave(f"model:{path.name}", state, stager, path, fmt, written, threads, incremental=incremental,
                      shards=replicated.model_shards(model))


def stage_optimizer(model: nn.Module, optimizer: Optimizer, path: Path, stager: HostStager,
                    written: WrittenFiles | None = None, *, threads: int | None = None,
                    small_apart: bool = False) -> StagedSave:
    """The first half of a background ``save_optimizer``: small values copied now, the moments later."""
    state = _freeze(state_dicts.optimizer_state_dict(model, optimizer))
    return StagedSave(f"optim:{path.name}", state, stager, path, DCP_FILES, written, threads, small_apart,
                      shards=replicated.optimizer_shards(model))


class ModelShards:
    """A model's files in the ``ShardsFormat`` ``fmt``: written now, or staged for the background (``stager``)."""

    def __init__(self, fmt: ShardsFormat, reuse: Reuse | None = None) -> None:
        self.fmt = fmt
        self.reuse = reuse  # ``checkpoint.incremental``: stable tensors apart, linked when unchanged

    def write_model(self, model: nn.Module, path: Path, stager: HostStager | None,
                    written: WrittenFiles | None = None, threads: int | None = None) -> StagedSave | None:
        """With a ``stager``: the model staged for a background write (``stage_model``); else written now."""
        if stager is not None:
            return stage_model(model, path, self.fmt, stager, written, threads=threads, reuse=self.reuse)
        save_model(model, path, self.fmt, written=written, reuse=self.reuse)
        return None


_SMALL_TENSOR_BYTES = 64 << 10  # tensors up to this size are copied when a background save is made, not later


def _freeze(state: Any, eager=None) -> Any:
    """``state`` with its plain values and small tensors copied now (all tensors of keys where ``eager(key)``)."""
    with torch.no_grad():
        return _frozen(state, eager, "")


def _frozen(state: Any, eager, key: str) -> Any:
    if isinstance(state, torch.Tensor):
        small = state.numel() * state.element_size() <= _SMALL_TENSOR_BYTES
        return state.detach().clone() if small or (eager is not None and eager(key)) else state
    if isinstance(state, dict):
        return {k: _frozen(v, eager, key or str(k)) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_frozen(v, eager, key) for v in state)
    return copy.deepcopy(state)


def wait_async_save(future: Future, path: Path) -> None:
    """Wait for a background write; a DCP failure becomes the same one-line error as a synchronous save's."""
    try:
        future.result()
    except CheckpointException as exc:
        raise save_failure(exc, path) from None


class HostStager:
    """Copies state dicts into host buffers kept for the next save (one memory copy a save; DTensors keep their
    sharding). A changed structure gets new buffers. Pinned where the state is on an accelerator; dropped pinned
    buffers are given back (``release_pinned``: the host caching allocator would keep them) before new ones."""

    def __init__(self) -> None:
        self._buffers: dict[str, Any] = {}

    @torch.no_grad()
    def stage(self, key: str, state: dict) -> dict:
        """A copy of ``state`` that later changes to the live tensors do not affect."""
        buffers = self._buffers.get(key)
        if buffers is not None:
            try:
                return self._copied(state, buffers)
            except _Mismatch:
                del self._buffers[key]
                buffers = None
                release_pinned()
        self._buffers[key] = buffers = _host_buffers(state)
        return self._copied(state, buffers)

    def _copied(self, state: dict, buffers: dict) -> dict:
        staged = _copy_into(state, buffers)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.current_stream().synchronize()  # the non-blocking device-to-host copies have landed
        return staged

    def close(self) -> None:
        self._buffers.clear()
        release_pinned()


def release_pinned() -> None:
    """Give unused pinned host blocks back to the OS (where an accelerator is in use and torch >= 2.13 can)."""
    empty = getattr(getattr(torch.accelerator, "memory", None), "empty_host_cache", None)
    if empty is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        empty()


class _Mismatch(Exception):
    """The state no longer has the structure its buffers were made for."""


def _host_buffers(obj: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        if obj.device.type == "cpu":  # an empty local shard with the same sharding
            return DTensor.from_local(torch.empty_like(obj.to_local()), obj.device_mesh, obj.placements,
                                      shape=obj.shape, stride=obj.stride(), run_check=False)
        host = obj.to("cpu")  # keeps the mesh and placements; the local shard moves to host memory
        host._local_tensor = host._local_tensor.pin_memory()
        return host
    if isinstance(obj, torch.Tensor):
        host = torch.empty_like(obj, device="cpu")
        return host.pin_memory() if obj.is_cuda else host
    if isinstance(obj, dict):
        return {k: _host_buffers(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_host_buffers(v) for v in obj)
    return None  # plain values are copied at every save


def _copy_into(src: Any, buf: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(src, torch.Tensor):
        if isinstance(src, DTensor) != isinstance(buf, DTensor) or not isinstance(buf, torch.Tensor):
            raise _Mismatch
        local_src, local_buf = (src.to_local(), buf.to_local()) if isinstance(src, DTensor) else (src, buf)
        if local_src.shape != local_buf.shape or local_src.dtype != local_buf.dtype or src.shape != buf.shape:
            raise _Mismatch
        local_buf.copy_(local_src, non_blocking=local_src.is_cuda)
        return buf
    if isinstance(src, dict):
        if not isinstance(buf, dict) or buf.keys() != src.keys():
            raise _Mismatch
        return {k: _copy_into(v, buf[k]) for k, v in src.items()}
    if isinstance(src, (list, tuple)):
        if not isinstance(buf, (list, tuple)) or len(buf) != len(src):
            raise _Mismatch
        return type(src)(_copy_into(v, b) for v, b in zip(src, buf))
    return copy.deepcopy(src)


def load_optimizer(model: nn.Module, optimizer: Optimizer, path: Path, process_group=None,
                   check: LoadCheck | None = None) -> None:
    fresh = not optimizer.state
    # Moments to load into, allocated without an optimizer step (torch steps on zero gradients where it cannot).
    created = fresh and fastio.init_optimizer_state(optimizer)
    try:
        state = get_optimizer_state_dict(model, optimizer)
        own = [group["params"] for group in state["param_groups"]]
        _load(state, path, _reader(path, DCP_FILES, check), process_group, strict_keys=False)
        # each group's parameter names are this rank's, whatever the saving ranks held (one pipeline stage's, once
        # saved: ranks that hold different parameters write them under one key)
        for group, params in zip(state["param_groups"], own):
            group["params"] = params
    except BaseException:
        if created:  # never leave the uninitialised moments behind
            optimizer.state.clear()
        raise
    set_optimizer_state_dict(model, optimizer, state)
