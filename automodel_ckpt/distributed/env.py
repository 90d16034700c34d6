"""Process-group lifecycle, rank helpers and small collectives that every rank must agree on."""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from automodel_ckpt.errors import UsageError


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def inside_launcher_worker() -> bool:
    """True when this process was started by torchrun (or an equivalent that sets its env)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def init_distributed(backend: str | None = None, timeout_minutes: int = 30) -> DistEnv:
    """Join the job's process group (a one-rank group in-process: one code path for 1 and N ranks), pick the device."""
    backend = backend or ("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    timeout = datetime.timedelta(minutes=timeout_minutes)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise UsageError(f"local rank {local_rank} has no GPU: {torch.cuda.device_count()} visible on this node; "
                             "start at most one process per GPU (--nproc-per-node), or set CUDA_VISIBLE_DEVICES= "
                             "to run on the CPU")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        if inside_launcher_worker():
            dist.init_process_group(backend=backend, timeout=timeout)
        else:
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, device, backend)


def shutdown_distributed() -> None:
    """Leave the process group once every rank got here, so no rank leaves while a peer still needs it."""
    if dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


def end_process(code: int) -> NoReturn:
    """End a process with exit status ``code`` without the interpreter's teardown: exit handlers run and this
    process's threads are joined, streams flushed, then ``os._exit``. A gloo thread freeing a tensor while the
    interpreter finalizes ends in ``std::terminate`` (a finished job exiting -6); the teardown also costs seconds."""
    import atexit
    import logging

    try:
        pools = sys.modules.get("concurrent.futures.thread")
        if pools is not None:  # idle executor workers (torch.compile's among them) end, as at interpreter exit
            pools._python_exit()
        for thread in threading.enumerate():
            if thread is not threading.current_thread() and not thread.daemon:
                thread.join()
        _keep_torch_libraries()
        atexit._run_exitfuncs()
        logging.shutdown()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        if code == 0 and _RETURN_ON_SUCCESS:  # a forked worker: its agent counts it done once it returns
            raise SystemExit(0)
        os._exit(code)


def _keep_torch_libraries() -> None:
    """torch's operator libraries' finalizers left out of the exit handlers: each unregisters its kernels (10-50 ms
    of CPU at every exit, for a process that ``os._exit`` ends next)."""
    import weakref

    for handle in list(getattr(weakref.finalize, "_registry", ())):  # CPython's registry of live finalizers
        func = (handle.peek() or (None, None))[1]
        if getattr(func, "__module__", "") == "torch.library" and func.__name__ == "_del_library":
            handle.atexit = False


#: Set in a worker forked by the launcher: ``end_process(0)`` unwinds to torch's agent, which counts it done.
_RETURN_ON_SUCCESS = False


def return_on_success() -> None:
    """This process is a forked worker: a successful ``end_process`` returns to its entry function."""
    global _RETURN_ON_SUCCESS
    _RETURN_ON_SUCCESS = True


def all_reduce_sum(value: float | torch.Tensor, group: Any = None) -> torch.Tensor:
    """Sum over the ranks of ``group`` (default: all) as float64 on the CPU group (exact counts, stable losses)."""
    t = torch.as_tensor(value, dtype=torch.float64).clone()
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


_THREAD = threading.local()


@contextlib.contextmanager
def collectives_on(group: Any):
    """This thread's object collectives and ``barrier`` run on ``group`` (checkpointing's), not training's default."""
    before = getattr(_THREAD, "group", None)
    _THREAD.group = group
    try:
        yield
    finally:
        _THREAD.group = before


def current_group() -> Any:
    """The group this thread's collectives run on (None: the default group); see ``collectives_on``."""
    return getattr(_THREAD, "group", None)


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=current_group())
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=current_group())
    return out


def gather_object(obj: Any, dst: int = 0) -> list[Any] | None:
    """Every rank's ``obj``, in rank order, on rank ``dst`` of this thread's group (None on the others)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [obj]
    group = current_group()
    out: list[Any] | None = [None] * dist.get_world_size(group) if dist.get_rank(group) == dst else None
    dist.gather_object(obj, out, group=group, group_dst=dst)
    return out


def scatter_object(objs: list[Any] | None, src: int = 0) -> Any:
    """``objs[r]`` (given on rank ``src`` of this thread's group) on each rank ``r``: each receives its own only."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return objs[0] if objs else None
    box: list[Any] = [None]
    dist.scatter_object_list(box, objs, group=current_group(), group_src=src)
    return box[0]


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier(group=current_group())
