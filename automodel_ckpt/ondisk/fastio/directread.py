"""Reading checkpoint files past the page cache, their checksums computed from the same buffers on the way.

Threads read regions with O_DIRECT into aligned buffers and copy out; ``hash_files`` hashed from them in order.

Why: through the page cache a load copies every byte twice and fills the cache with gigabytes read once; an O_DIRECT
read lands in our aligned buffer, and one ``copy_`` (which releases the GIL) puts it in place while the other
threads' reads are in flight. Where a filesystem refuses O_DIRECT (``EINVAL``: tmpfs) the same buffers read through
the page cache."""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import errno
import logging
import os
import threading
from pathlib import Path
from typing import Any, Callable

import torch

from automodel_ckpt.ondisk.paths import open_regular
from automodel_ckpt.ondisk.fastio import session
from automodel_ckpt.ondisk.fastio.common import BYTES_READ
from automodel_ckpt.ondisk.formats.safetensors_io import pread_full

log = logging.getLogger(__name__)

REGION = 8 << 20  # bytes per read (one page-aligned buffer of this size per thread, and a few spare)
_ALIGN = 4096  # O_DIRECT offsets, lengths and buffer addresses are multiples of this
SMALL_REGION = 1 << 20  # regions below this size (a few small items: another rank's step counts) are read first
GAP = 1 << 20  # unneeded bytes between two needed ranges of a file that are read rather than skipped
DIRECT_READ_MIN = 16 << 20  # files from this size on are read with O_DIRECT (smaller ones: page cache)
ENV = "AUTOMODEL_CKPT_DIRECT_READ"  # "off": always through the page cache; "force": O_DIRECT whatever the size


def _mode() -> str:
    """``auto`` (O_DIRECT for large files), ``off`` or ``force``, from the environment variable ``ENV``."""
    value = os.environ.get(ENV, "auto").strip().lower()
    return value if value in ("auto", "off", "force") else "auto"


def wanted(size: int) -> bool:
    """Whether a file of ``size`` bytes is read with O_DIRECT (where the filesystem allows it)."""
    m = _mode()
    return hasattr(os, "O_DIRECT") and (m == "force" or (m == "auto" and size >= DIRECT_READ_MIN))


class Segment:
    """Bytes ``[start, start + nbytes)`` of a file for ``dest`` (or ``make()``'s, made late); ``done()`` after."""

    __slots__ = ("start", "nbytes", "dest", "make", "done", "_left", "_lock")

    def __init__(self, start: int, dest: torch.Tensor | None = None, *, nbytes: int | None = None,
                 make: Callable[[], torch.Tensor] | None = None, done: Callable[[], None] | None = None) -> None:
        assert dest is not None or (make is not None and nbytes is not None)
        self.start = start
        self.nbytes = dest.numel() if nbytes is None else nbytes
        self.dest, self.make, self.done = dest, make, done
        self._left = self.nbytes
        self._lock = threading.Lock()

    def target(self) -> torch.Tensor:
        if self.dest is None:
            with self._lock:
                if self.dest is None:
                    self.dest = self.make()
        return self.dest

    def arrived(self, n: int) -> None:
        with self._lock:
            self._left -= n
            last = self._left == 0
        if last:
            if self.done is not None:
                self.done()
            if self.make is not None:
                self.dest = None  # the buffer goes with its piece


@dataclasses.dataclass
class _Region:
    file: int  # index into the files
    lo: int
    hi: int
    segments: list[Segment]
    hashed: bool


class _File:
    def __init__(self, path: str, size: int, direct: bool) -> None:
        self.path, self.size, self.direct = path, size, direct
        self.lock = threading.Lock()
        self.fd: int | None = None
        self.direct_fd: int | None = None

    def fds(self) -> tuple[int, int | None]:
        with self.lock:
            if self.fd is None:
                self.fd = open_regular(Path(self.path), follow=True)  # never a FIFO or device (a base's cache links)
                if self.direct:
                    try:
                        self.direct_fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
                    except OSError as exc:
                        if exc.errno != errno.EINVAL:
                            raise
                        self.direct = False  # refused here: through the page cache
            return self.fd, self.direct_fd

    def refuse_direct(self) -> None:
        with self.lock:
            self.direct = False  # its descriptor stays open until ``close``: other threads may be reading with it

    def close(self) -> None:
        for fd in (self.fd, self.direct_fd):
            if fd is not None:
                os.close(fd)
        self.fd = self.direct_fd = None


def _plan(path: str, size: int, segments: list[Segment], whole: bool, index: int, gap: int = GAP) -> list[_Region]:
    """The file's reads: needed ranges (or the whole file) in page-aligned regions of at most ``REGION`` bytes."""
    segments = sorted((s for s in segments if s.nbytes), key=lambda s: s.start)
    ranges: list[list[int]] = [[0, size]] if whole else []
    if not whole:
        for s in segments:
            a, b = s.start // _ALIGN * _ALIGN, s.start + s.nbytes
            if ranges and a <= ranges[-1][1] + gap:
                ranges[-1][1] = max(ranges[-1][1], b)
            else:
                ranges.append([a, b])
    regions: list[_Region] = []
    for a, b in ranges:
        b = min(size, -(-b // _ALIGN) * _ALIGN)  # whole pages (O_DIRECT reads nothing less), up to the end of file
        for lo in range(a, b, REGION):
            regions.append(_Region(index, lo, min(b, lo + REGION), [], whole))
    if not regions:
        return regions
    starts = [r.lo for r in regions]

    for s in segments:  # every segment into the regions it overlaps (a segment may span several)
        i = bisect.bisect_right(starts, s.start) - 1
        end = s.start + s.nbytes
        while i < len(regions) and regions[i].lo < end:
            if regions[i].hi > s.start:
                regions[i].segments.append(s)
            i += 1
    return regions


class _Abortable:
    """A condition whose waiters stop waiting once ``abort`` is called (one failed reader stops them all)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.failed = False

    def abort(self) -> None:
        with self.cond:
            self.failed = True
            self.cond.notify_all()


class _Ordered(_Abortable):
    """Feeds hashed regions to their files' hashers in file order, on one thread, then frees their buffers."""

    def __init__(self, order: list[tuple[int, int]], hashers: dict[int, Any], release: Any) -> None:
        super().__init__()
        self.order = order  # (region number, file number) of the regions to hash, in file order
        self.hashers = hashers
        self.release = release
        self.ready: dict[int, tuple[Any, int]] = {}
        self.thread = threading.Thread(target=self._run, name="ckpt-read-hash", daemon=True)
        self.error: BaseException | None = None
        self.on_error: Any = None

    def put(self, number: int, buffer: Any, n: int) -> None:
        with self.cond:
            self.ready[number] = (buffer, n)
            self.cond.notify_all()

    def _run(self) -> None:
        try:
            self._consume()
        except BaseException as exc:  # noqa: BLE001 - reported by read_files
            self.error = exc
            if self.on_error is not None:
                self.on_error()  # the readers wait for buffers only this thread gives back

    def _consume(self) -> None:
        for number, file in self.order:
            with self.cond:
                self.cond.wait_for(lambda: number in self.ready or self.failed)
                if self.failed:
                    return
                buffer, n = self.ready.pop(number)
            self.hashers[file].update(memoryview(buffer)[:n])
            self.release(buffer)


class _Pool(_Abortable):
    """Page-aligned buffers of ``REGION`` bytes (anonymous mappings are page-aligned), reused for every read."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.free = session.buffers(count, REGION)  # a load's earlier reads may have left some
        self.all = list(self.free)

    def get(self) -> Any:
        with self.cond:
            self.cond.wait_for(lambda: self.free or self.failed)
            if self.failed:
                raise _Aborted
            return self.free.pop()

    def put(self, buffer: Any) -> None:
        with self.cond:
            self.free.append(buffer)
            self.cond.notify()

    def close(self) -> None:
        if not self.failed and session.give_back(self.all, REGION):
            return
        for buffer in self.all:
            with contextlib.suppress(BufferError):  # a view still exported (a failed read): freed with the object
                buffer.close()


class _Aborted(Exception):
    pass


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Read up to ``view.nbytes`` at ``offset``; stops at the end of the file. Returns the bytes read."""
    done = pread_full(fd, view, offset)
    BYTES_READ.add(done)
    return done


def _read_region(file: _File, region: _Region, buffer: Any) -> int:
    fd, direct_fd = file.fds()
    view = memoryview(buffer)
    n = region.hi - region.lo
    aligned = 0
    if direct_fd is not None and file.direct:
        aligned = min(n, (file.size - region.lo) // _ALIGN * _ALIGN)  # whole pages; the file's tail: page cache
        try:
            got = _pread_into(direct_fd, view[:aligned], region.lo) if aligned else 0
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            file.refuse_direct()  # accepted at open, refused at read: the page cache from here on
            got, aligned = 0, 0
        if got < aligned:
            raise OSError(f"unexpected end of file at byte {region.lo + got} of '{file.path}'")
    if n > aligned:
        got = _pread_into(fd, view[aligned:n], region.lo + aligned)
        if got < n - aligned:
            raise OSError(f"unexpected end of file at byte {region.lo + aligned + got} of '{file.path}'")
    return n


def _copy_out(region: _Region, tensor: torch.Tensor) -> None:
    for s in region.segments:
        a, b = max(region.lo, s.start), min(region.hi, s.start + s.nbytes)
        if b > a:  # a tensor copy: without the GIL, so the threads copy at once
            s.target()[a - s.start:b - s.start].copy_(tensor[a - region.lo:b - region.lo])
            s.arrived(b - a)


def read_files(segments: dict[str, list[Segment]], threads: int, *, sizes: dict[str, int] | None = None,
               hash_files: dict[str, Any] | None = None, gap: int = GAP) -> dict[str, int]:
    """Copy every segment's bytes from its file into its ``dest``; returns ``{path: bytes read}``. ``hash_files``:
    ``{path: hasher}`` of files read whole and hashed in order. ``gap``: unneeded bytes between two needed ranges
    read rather than skipped."""
    hash_files = hash_files or {}
    paths = sorted(set(segments) | set(hash_files))
    files: list[_File] = []
    regions: list[_Region] = []
    for index, path in enumerate(paths):
        size = (sizes or {}).get(path)
        if size is None:
            size = os.stat(path).st_size
        files.append(_File(path, size, wanted(size)))
        regions += _plan(path, size, segments.get(path, []), path in hash_files, index, gap)
    # small regions first (else file order; hashed ones keep theirs): not last, behind the large reads
    regions.sort(key=lambda r: r.hashed or r.hi - r.lo >= SMALL_REGION)
    read = {path: 0 for path in paths}
    if not regions:
        return read
    threads = max(1, min(threads, len(regions)))
    pool = _Pool(threads + (2 if hash_files else 0))
    hasher = _Ordered([(i, r.file) for i, r in enumerate(regions) if r.hashed],
                      {i: hash_files[p] for i, p in enumerate(paths) if p in hash_files}, pool.put) \
        if hash_files else None
    tensors = {id(b): torch.frombuffer(b, dtype=torch.uint8) for b in pool.all}
    lock = threading.Lock()
    cursor = [0]
    totals = [0] * len(files)

    def abort() -> None:
        pool.abort()
        if hasher is not None:
            hasher.abort()

    if hasher is not None:
        hasher.on_error = abort

    def work() -> None:
        try:
            _work()
        except _Aborted:
            raise
        except BaseException:
            abort()  # at once: threads waiting for a buffer, and the hasher waiting for this region, stop
            raise

    def _work() -> None:
        while True:
            buffer = pool.get()  # a buffer before a region: the oldest regions in flight always hold one
            with lock:
                number = cursor[0]
                cursor[0] += 1
            if number >= len(regions):
                pool.put(buffer)
                return
            region = regions[number]
            n = _read_region(files[region.file], region, buffer)
            _copy_out(region, tensors[id(buffer)])
            with lock:
                totals[region.file] += n
            if hasher is not None and region.hashed:
                hasher.put(number, buffer, n)
            else:
                pool.put(buffer)

    if hasher is not None:
        hasher.thread.start()
    try:
        with session.pool(threads) as executor:
            futures = [executor.submit(work) for _ in range(threads)]
            error: BaseException | None = None
            for f in futures:
                try:
                    f.result()
                except _Aborted:
                    pass
                except BaseException as exc:  # noqa: BLE001 - the first failure stops the others
                    if error is None:
                        error = exc
            if error is not None:
                raise error
        if hasher is not None:
            hasher.thread.join()
            if hasher.error is not None:
                raise hasher.error
    finally:
        if hasher is not None:
            hasher.abort()
            hasher.thread.join()
        for file in files:
            file.close()
        tensors.clear()
        pool.close()
    for i, path in enumerate(paths):
        read[path] = totals[i]
    return read
