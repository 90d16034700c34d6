"""Reader threads and page-aligned read buffers kept for all the reads of one load (model, optimizer, ...).

Inside ``kept()`` read calls share one thread pool, started while the load plans, and their buffers."""

from __future__ import annotations

import contextlib
import mmap
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Callable, Iterator

from automodel_ckpt.ondisk.fastio.common import READ_THREADS, default_threads

THREAD_PREFIX = "ckpt-read"

_lock = threading.Lock()
_active: "_Session | None" = None


_STARTED_WITHIN = 10.0  # seconds a session's threads wait for each other when they start (then go on alone)


class _Session:
    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.executor = ThreadPoolExecutor(threads, thread_name_prefix=THREAD_PREFIX)
        self.spare: dict[int, list[mmap.mmap]] = {}
        # Every thread starts now (an executor starts one only while none is idle): each task waits for all to run.
        started = threading.Barrier(threads)
        for _ in range(threads):
            self.executor.submit(_wait_for_the_others, started)

    def close(self) -> None:
        self.executor.shutdown(wait=True)
        for buffers in self.spare.values():
            for buffer in buffers:
                buffer.close()
        self.spare.clear()


def _wait_for_the_others(started: threading.Barrier) -> None:
    with contextlib.suppress(threading.BrokenBarrierError):  # a thread that did not start in time: read without it
        started.wait(_STARTED_WITHIN)


@contextlib.contextmanager
def kept(threads: int = READ_THREADS) -> Iterator[None]:
    """Keep reader threads and buffers for every read inside (nested sessions use the outermost one)."""
    global _active
    with _lock:
        if _active is not None:
            outer = True
        else:
            outer, _active = False, _Session(default_threads(threads))
    if outer:
        yield
        return
    try:
        yield
    finally:
        with _lock:
            session, _active = _active, None
        if session is not None:
            session.close()


class _Borrowed:
    """The session's pool, lent to one call: ``submit`` as on an executor; leaving waits for what was submitted."""

    def __init__(self, executor: ThreadPoolExecutor) -> None:
        self.executor = executor
        self.futures: list[Future] = []

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future = self.executor.submit(fn, *args)
        self.futures.append(future)
        return future


@contextlib.contextmanager
def pool(workers: int) -> Iterator[Any]:
    """An executor of ``workers`` threads: the session's (unless called from one of them), else new; on leaving,
    every task has finished."""
    session = _active
    if session is None or workers > session.threads or threading.current_thread().name.startswith(THREAD_PREFIX):
        with ThreadPoolExecutor(workers, thread_name_prefix=THREAD_PREFIX) as own:
            yield own
        return
    borrowed = _Borrowed(session.executor)
    try:
        yield borrowed
    finally:
        wait(borrowed.futures)


def buffers(count: int, size: int) -> list[mmap.mmap]:
    """``count`` page-aligned buffers of ``size`` bytes: the session's spare ones first, then new mappings."""
    session = _active
    out: list[mmap.mmap] = []
    if session is not None:
        with _lock:
            spare = session.spare.get(size, [])
            while spare and len(out) < count:
                out.append(spare.pop())
    return out + [mmap.mmap(-1, size) for _ in range(count - len(out))]


def give_back(buffers_: list[mmap.mmap], size: int) -> bool:
    """Keep ``buffers_`` for the session's next read; False (not kept: close them) outside a session."""
    session = _active
    if session is None:
        return False
    with _lock:
        session.spare.setdefault(size, []).extend(buffers_)
    return True
