"""Writing one checkpoint file from tensor memory, its checksum computed on the way."""

from __future__ import annotations

import bisect
import dataclasses
import errno
import mmap
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import torch

from automodel_ckpt.ondisk import checksum, durable
from automodel_ckpt.ondisk.fastio import common
from automodel_ckpt.ondisk.fastio.common import tensor_memory

DIRECT_MIN = 1 << 20  # files from this size on are written with O_DIRECT where the filesystem allows it (a
# page-cache copy and its writeback took 40% of an async save's background CPU from training: docs/benchmarks.md)
DIRECT_CHUNK = 2 << 20  # bytes per O_DIRECT write (one page-aligned buffer of this size per writer thread)
_ALIGN = 4096  # O_DIRECT offsets, lengths and buffer addresses are multiples of this
_SPARE: dict[int, list] = {}  # mapped region buffers by size, kept for the next file and save: a new mapping's first
_SPARE_LOCK = threading.Lock()  # touch (a page fault a page) took an async save more CPU than the copies into it


class Lazy:
    """A tensor's bytes in a file plan: materialised (made contiguous, moved to the CPU) only when written."""

    __slots__ = ("tensor", "nbytes")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.nbytes = tensor.numel() * tensor.element_size()

    @property
    def direct(self) -> bool:
        """Whether the bytes can be used in place (CPU, contiguous)."""
        return self.tensor.device.type == "cpu" and self.tensor.is_contiguous()

    def materialise(self) -> tuple[torch.Tensor, memoryview]:
        t = self.tensor.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        return t, tensor_memory(t)


def piece_length(piece: Any) -> int:
    return piece.nbytes if isinstance(piece, (Lazy, memoryview)) else len(piece)


@dataclasses.dataclass
class _Unit:
    """One positioned write: consecutive pieces (or part of one large piece) at ``offset``."""

    offset: int
    parts: list[tuple[Any, int, int]]  # (piece, start, stop) within the piece


def _units(pieces: list[Any]) -> Iterator[_Unit]:
    """Split the file into writes of about ``common.CHUNK`` bytes: small pieces together, large ones in slices."""
    offset = 0
    pending: list[tuple[Any, int, int]] = []
    pending_at, pending_len = 0, 0
    for piece in pieces:
        n = piece_length(piece)
        if n == 0:
            continue
        if n < common.SMALL and pending_len + n <= common.CHUNK:
            if not pending:
                pending_at = offset
            pending.append((piece, 0, n))
            pending_len += n
            offset += n
            continue
        if pending:
            yield _Unit(pending_at, pending)
            pending, pending_len = [], 0
        if isinstance(piece, Lazy) and not piece.direct:  # materialised once, by the one write of it
            yield _Unit(offset, [(piece, 0, n)])
            offset += n
            continue
        for start in range(0, n, common.CHUNK):
            stop = min(n, start + common.CHUNK)
            yield _Unit(offset + start, [(piece, start, stop)])
        offset += n
    if pending:
        yield _Unit(pending_at, pending)


def _pwrite_all(fd: int, buffers: list[memoryview], offset: int) -> None:
    while buffers:
        written = os.pwritev(fd, buffers, offset) if len(buffers) > 1 else os.pwrite(fd, buffers[0], offset)
        if written <= 0:
            raise OSError(f"no progress writing at byte {offset}")
        offset += written
        while buffers and written >= buffers[0].nbytes:
            written -= buffers[0].nbytes
            buffers.pop(0)
        if buffers and written:
            buffers[0] = buffers[0][written:]


class _Hasher:
    """The file's checksum (the manifest's algorithm), fed with its bytes in file order from a thread of its own."""

    def __init__(self) -> None:
        self.algorithm = checksum.default_algorithm()
        self._h = checksum.hasher(self.algorithm)
        self.ok = False

    def feed(self, pieces: list[Any]) -> None:
        try:
            self._feed(pieces)
            self.ok = True
        except Exception:  # noqa: BLE001 - no checksum then: the manifest reads the file instead
            self.ok = False

    def _feed(self, pieces: list[Any]) -> None:
        for piece in pieces:
            if isinstance(piece, Lazy):
                _, view = piece.materialise()  # direct pieces only: a view, no copy
            else:
                view = memoryview(piece).cast("B") if not isinstance(piece, memoryview) else piece
            for start in range(0, view.nbytes, 8 << 20):
                self._h.update(view[start:start + (8 << 20)])

    def update(self, view: memoryview) -> None:
        self._h.update(view)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def _open_direct(path: Path) -> int | None:
    """A second descriptor of ``path`` that writes past the page cache; None where refused, or on tmpfs."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag or common.memory_backed(path):
        return None
    try:
        return os.open(path, os.O_WRONLY | flag)
    except OSError:
        return None


def _write_direct(fd: int, direct_fd: int, pieces: list[Any], total: int, threads: int,
                  hasher: "_Hasher | None" = None) -> None:
    """Write the file in page-aligned ``DIRECT_CHUNK`` regions, each gathered from the (contiguous, maybe
    accelerator) pieces into an aligned buffer and written through ``direct_fd``; the unaligned tail through
    ``fd``. With ``hasher``, each region is hashed from its buffer in file order before the buffer is reused."""
    starts, offset = [], 0
    for piece in pieces:
        starts.append(offset)
        offset += piece_length(piece)

    def fill_and_write(view: memoryview, into: torch.Tensor, lo: int) -> int:
        hi = min(total, lo + DIRECT_CHUNK)
        i = bisect.bisect_right(starts, lo) - 1
        while i < len(pieces) and starts[i] < hi:
            piece, at = pieces[i], starts[i]
            a, b = max(lo, at), min(hi, at + piece_length(piece))
            if b > a and isinstance(piece, Lazy):  # a tensor copy: without the GIL, so threads copy at once
                into[a - lo:b - lo].copy_(piece.tensor.detach().reshape(-1).view(torch.uint8)[a - at:b - at])
            elif b > a:
                source = memoryview(piece).cast("B") if not isinstance(piece, memoryview) else piece
                view[a - lo:b - lo] = source[a - at:b - at]
            i += 1
        n = hi - lo
        aligned = n // _ALIGN * _ALIGN
        if aligned:
            _pwrite_all(direct_fd, [view[:aligned]], lo)
        if n > aligned:
            _pwrite_all(fd, [view[aligned:n]], lo + aligned)
        return n

    regions = list(range(0, total, DIRECT_CHUNK))
    pinned = any(isinstance(p, Lazy) and p.tensor.is_cuda for p in pieces)
    if hasher is None:
        local, made = threading.local(), []

        def region(lo: int) -> None:
            if not hasattr(local, "buffer"):
                local.buffer = _chunk_buffer(pinned)
                made.append(local.buffer)
            fill_and_write(*local.buffer, lo)

        _run_all(region, regions, threads)
        return _keep(made, pinned)
    _write_direct_hashed(fill_and_write, regions, threads, hasher, pinned)


def _keep(slots: list[tuple[memoryview, torch.Tensor]], pinned: bool) -> None:
    with _SPARE_LOCK:  # at most two files' pools of 2 x WRITE_THREADS buffers
        (spare := _SPARE.setdefault(DIRECT_CHUNK, [])).extend([] if pinned else slots)
        del spare[4 * common.WRITE_THREADS:]


def _chunk_buffer(pinned: bool) -> tuple[memoryview, torch.Tensor]:
    """A page-aligned ``DIRECT_CHUNK`` buffer as ``(bytes, uint8 tensor)``: pinned for a GPU's tensors, else mapped."""
    if pinned:
        try:
            tensor = torch.empty(DIRECT_CHUNK, dtype=torch.uint8, pin_memory=True)
        except RuntimeError:  # no accelerator to pin for after all
            tensor = None
        if tensor is not None and tensor.data_ptr() % _ALIGN == 0:
            return tensor_memory(tensor, writable=True), tensor
    with _SPARE_LOCK:
        if spare := _SPARE.get(DIRECT_CHUNK):
            return spare.pop()
    buffer = mmap.mmap(-1, DIRECT_CHUNK)
    return memoryview(buffer), torch.frombuffer(buffer, dtype=torch.uint8)


def _write_direct_hashed(fill_and_write: Any, regions: list[int], threads: int, hasher: "_Hasher",
                         pinned: bool = False) -> None:
    """The regions written from a pool of buffers handed out in file order, hashed in file order and given back
    once hashed (so the earliest unhashed region always holds one: the pool never runs dry); the first failure
    stops the rest."""
    free: queue.Queue = queue.Queue()
    for _ in range(min(len(regions), 2 * max(1, threads))):
        free.put(_chunk_buffer(pinned))
    lock, done, failed = threading.Lock(), {}, threading.Event()
    next_region = [regions[0] if regions else 0]

    def region(lo: int, slot: tuple[memoryview, torch.Tensor]) -> None:
        try:
            n = fill_and_write(slot[0], slot[1], lo)
            with lock:
                done[lo] = (slot, n)
                while next_region[0] in done:
                    ready, length = done.pop(next_region[0])
                    hasher.update(ready[0][:length])
                    free.put(ready)
                    next_region[0] += DIRECT_CHUNK
        except BaseException:
            failed.set()
            free.put(slot)  # the dispatcher, waiting for a buffer, sees the failure
            raise

    futures = []
    with ThreadPoolExecutor(max(1, min(threads, len(regions))), thread_name_prefix="ckpt-write") as pool:
        for lo in regions:
            slot = free.get()
            if failed.is_set():
                break
            futures.append(pool.submit(region, lo, slot))
        for f in futures:
            f.result()
    hasher.ok = not failed.is_set()
    _keep([free.get() for _ in range(free.qsize())], pinned)


def _run_all(work: Any, items: list[Any], threads: int) -> None:
    """``work(item)`` for every item, on up to ``threads`` threads; the first failure stops the rest."""
    if threads <= 1 or len(items) <= 1:
        for item in items:
            work(item)
        return
    with ThreadPoolExecutor(min(threads, len(items)), thread_name_prefix="ckpt-write") as pool:
        futures = [pool.submit(work, item) for item in items]
        try:
            for f in futures:
                f.result()
        except BaseException:
            for f in futures:  # a failed write (disk full ...): the rest is not attempted
                f.cancel()
            raise


def write_file(path: Path, pieces: list[Any], threads: int, written: durable.WrittenFiles | None = None) -> int:
    """Write ``pieces`` into ``path``, fsynced and recorded in ``written`` with its checksum; returns its size."""
    path = Path(path)
    total = sum(piece_length(p) for p in pieces)
    in_place = all(not isinstance(p, Lazy) or p.direct for p in pieces)  # a checksum thread reads them as they are
    contiguous = all(not isinstance(p, Lazy) or p.tensor.is_contiguous() for p in pieces)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    direct_fd = _open_direct(path) if contiguous and total >= DIRECT_MIN else None
    # hashed by a thread of its own (in place), from the O_DIRECT buffers (an accelerator's tensors), or not at all:
    # then the manifest reads the file back
    hasher = _Hasher() if in_place or direct_fd is not None else None
    hash_thread = threading.Thread(target=hasher.feed, args=(pieces,), daemon=True) if in_place else None
    try:
        if hash_thread is not None:
            hash_thread.start()

        def write(unit: _Unit) -> None:
            keep = []
            views = []
            for piece, start, stop in unit.parts:
                if isinstance(piece, Lazy):
                    t, view = piece.materialise()
                    keep.append(t)
                else:
                    view = memoryview(piece).cast("B") if not isinstance(piece, memoryview) else piece
                views.append(view[start:stop])
            _pwrite_all(fd, views, unit.offset)
            durable.start_writeback(fd, unit.offset, sum(v.nbytes for v in views))

        done = False
        if direct_fd is not None:
            try:
                _write_direct(fd, direct_fd, pieces, total, threads, None if in_place else hasher)
                done = True
            except OSError as exc:
                if exc.errno != errno.EINVAL:  # disk full and the like are the caller's; EINVAL: O_DIRECT refused
                    raise
            finally:
                os.close(direct_fd)
        if not done:
            if not in_place:
                hasher = None  # the buffered path hashes nothing: the manifest reads the file back
            _run_all(write, list(_units(pieces)), threads)
        os.fsync(fd)
    finally:
        os.close(fd)
        if hash_thread is not None:
            hash_thread.join()
    if written is not None and hasher is not None and hasher.ok:
        written.note(path, synced=True, algorithm=hasher.algorithm, digest=hasher.hexdigest())
    elif written is not None:
        written.note(path, synced=True)
    return total

