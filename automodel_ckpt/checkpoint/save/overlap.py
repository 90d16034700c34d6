"""The background half of an async save: capture and write on a low-priority thread, and the fence that waits for the capture."""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import re
import threading
import time
import warnings
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

logger = logging.getLogger(__name__)

WRITE_THREADS_MAX = 4  # background writer threads per rank, at most (by default)
_ASYNC_MIN_TORCH = (2, 9)


def async_supported(warn: bool) -> bool:
    """``checkpoint.is_async`` needs torch >= 2.9; older versions save synchronously, with a one-line warning."""
    import torch

    version = tuple(int(p) for p in re.findall(r"\d+", torch.__version__.split("+")[0])[:2])
    if version >= _ASYNC_MIN_TORCH:
        return True
    if warn:
        warnings.warn(f"checkpoint.is_async needs torch >= {'.'.join(map(str, _ASYNC_MIN_TORCH))} (found "
                      f"{torch.__version__}); saving synchronously", stacklevel=4)
    return False


class _Staged(Protocol):
    """What ``start`` runs: ``sharded.StagedSave``."""

    def capture(self) -> None: ...

    def write(self, process_group: Any) -> None: ...

    def fail(self, error: BaseException, process_group: Any) -> None: ...


def default_write_threads(cpu_count: int | None = None, local_ranks: int | None = None) -> int:
    """Writer threads per rank by default: the cores left per local rank, 1 to ``WRITE_THREADS_MAX``."""
    cores = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
    ranks = local_ranks if local_ranks is not None else int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1, min(WRITE_THREADS_MAX, cores // max(1, ranks) - 1))


def lower_priority(nice: int | str, tid: int = 0) -> None:
    """Thread ``tid`` (0: the calling one) under Linux's ``SCHED_IDLE`` for ``idle`` (only on cores nothing else
    wants; else niceness 19), or its niceness raised by ``nice`` (per thread; the threads it starts inherit either)."""
    if nice == "idle" and hasattr(os, "SCHED_IDLE"):
        with contextlib.suppress(OSError):  # refused: the lowest niceness instead
            return os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    nice = 19 if nice == "idle" else nice
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        tid = tid or threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError as exc:  # not fatal: the writes just compete with training at the same priority
        logger.debug("cannot lower the checkpoint thread's priority: %s", exc)


def threads_lowered(make: Callable[[], Any], nice: int | str, tasks: str = "/proc/self/task") -> Any:
    """``make()``, each thread it starts (a process group's transport threads) under ``lower_priority(nice)``."""
    before = set(os.listdir(tasks)) if os.path.isdir(tasks) else None
    made = make()
    for tid in set(os.listdir(tasks)) - before if before is not None else ():
        lower_priority(nice, int(tid))
    return made


@dataclass
class Overlapped:
    """One async save's background work: ``captured`` is done once every state is copied; one future per write."""

    captured: Future = field(default_factory=Future)
    writes: list[Future] = field(default_factory=list)
    fence_seconds: float = 0.0  # how long the training thread waited at fences for this save
    capture_seconds: float = 0.0  # how long the background copy of the live state took
    completed: Future | None = None  # with ``after_writes``: its result (the published checkpoint) or its failure

    def fence(self) -> None:
        """Block until the live state is copied (the state may be changed after this returns)."""
        if self.captured.done():
            return
        t0 = time.perf_counter()
        self.captured.exception()  # waits; a failed capture is raised by the writes, at completion
        self.fence_seconds += time.perf_counter() - t0


class BackgroundThread:
    """One daemon thread at niceness ``nice`` for the async saves' background work, kept from save to save (a
    queue put, not a thread start of milliseconds); ``close`` lets it end after its work."""

    def __init__(self, nice: int, name: str = "ckpt-async") -> None:
        self.nice, self.name = nice, name
        self._queue: queue.SimpleQueue | None = None

    def submit(self, work: Callable[[], None]) -> None:
        if self._queue is None:
            self._queue = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(self._queue,), name=self.name, daemon=True).start()
        self._queue.put(work)

    def _serve(self, jobs: queue.SimpleQueue) -> None:
        lower_priority(self.nice)
        while (work := jobs.get()) is not None:
            work()

    def close(self) -> None:
        """The thread ends once the work handed to it is done; a later ``submit`` starts another."""
        if self._queue is not None:
            self._queue.put(None)
            self._queue = None


def start(items: list[_Staged], process_group: Any, *, nice: int,
          before_writes: Callable[[], Any] | None = None, after_writes: Callable[[], Any] | None = None,
          name: str = "ckpt-async", thread: BackgroundThread | None = None) -> Overlapped:
    """Capture every item, then ``before_writes``, each write in order and ``after_writes`` on one daemon thread
    (``thread``'s, else its own) at niceness ``nice``. They are collective on ``process_group``: a rank whose
    capture or ``before_writes`` failed still enters every write, which then fails on every rank (no hang)."""
    job = Overlapped(writes=[Future() for _ in items], completed=Future() if after_writes is not None else None)
    ready = _device_work_so_far()

    def run() -> None:
        if thread is None:
            lower_priority(nice)
        error: BaseException | None = None
        t0 = time.perf_counter()
        try:
            with _copy_stream(ready):
                for item in items:
                    item.capture()
        except BaseException as exc:  # noqa: BLE001 - raised through the writes below
            error = exc
        finally:
            job.capture_seconds = time.perf_counter() - t0
            job.captured.set_result(None)
        if before_writes is not None:
            try:
                before_writes()
            except BaseException as exc:  # noqa: BLE001 - raised through the writes below
                error = error or exc
        for item, future in zip(items, job.writes):
            try:
                item.write(process_group) if error is None else item.fail(error, process_group)
            except BaseException as exc:  # noqa: BLE001 - the save's completion raises it
                future.set_exception(exc)
            else:
                future.set_result(None)
        if after_writes is not None and job.completed is not None:
            try:
                job.completed.set_result(after_writes())
            except BaseException as exc:  # noqa: BLE001 - raised on the training thread by the next wait
                job.completed.set_exception(exc)

    if thread is not None:
        thread.submit(run)
    else:
        threading.Thread(target=run, name=name, daemon=True).start()
    return job


def _device_work_so_far() -> Any:
    """On a GPU: an event after the work queued so far on this thread's stream (the last optimizer step); else None."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    event = torch.cuda.Event()
    event.record()
    return torch.cuda.current_device(), event


@contextlib.contextmanager
def _copy_stream(ready: Any):
    """On a GPU: copy on its own stream after ``ready``, overlapping the next step's kernels; ends when landed."""
    if ready is None:
        yield
        return
    import torch

    device, event = ready
    with torch.cuda.device(device):
        stream = torch.cuda.Stream()
        stream.wait_event(event)
        with torch.cuda.stream(stream):
            yield
        stream.synchronize()


@dataclass
class PendingSave:
    """A save whose model/optimizer files may still be written in the background (``writes``)."""

    name: str
    staging: Path
    consolidate: bool
    writes: list[tuple[Future, Path]] = field(default_factory=list)
    job: Overlapped | None = None  # the background capture, writes and (unless ``consolidate``) completion
    small_files: Any = None  # ``writer.LocalFiles`` still to be written by the completion, if any
    step: int = 0  # the training step it saves

    def wait_for_writes(self, seconds: float) -> bool:
        """Wait up to ``seconds`` in all for the background writes, whatever their outcome; whether all ended."""
        deadline = time.monotonic() + seconds
        unfinished = 0
        for future, _ in self.writes:
            try:
                future.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                unfinished += 1
            except Exception:  # noqa: BLE001 - the run is failing already; its own error is the one to show
                pass
        if unfinished:
            logger.warning("abandoning %d background checkpoint write(s) still running after %.0f s", unfinished, seconds)
        return not unfinished
