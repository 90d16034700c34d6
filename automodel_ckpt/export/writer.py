"""Streams tensor pieces from shard files into output safetensors files, a bounded amount of memory at a time.

Every output file's layout is fixed before a byte is written, so each piece goes straight to its place, by any
thread, in any order. Pieces contiguous in the output (row-split FSDP shards) are copied in the kernel, or converted
in small chunks; only others (a column split) are assembled whole in memory.
"""

from __future__ import annotations

import errno
import math
import mmap
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from automodel_ckpt.ondisk import (c_strides, encode_header, layout_order, open_regular, pwrite_all, st_dtype_name,
                                   start_writeback)
from automodel_ckpt.export.sources import Piece, SourceTensor, load_dcp_piece, read_full
from automodel_ckpt.export.views import flat_range
from automodel_ckpt.errors import CheckpointError, first_line


_COPY_CHUNK = 32 * 2**20  # bytes per copy task: big enough to stream, small enough to spread over threads
_CONVERT_CHUNK = 16 * 2**20  # source bytes converted at a time, per thread
_MIN_ASSEMBLY_BUDGET = 256 * 2**20  # tensors assembled in memory at once (at least the largest one)
_HEADER_METADATA = {"format": "pt"}


@dataclass
class OutTensor:
    source: SourceTensor
    dtype: torch.dtype
    offset: int = 0  # absolute byte offset in the output file

    @property
    def name(self) -> str:
        return self.source.name

    @property
    def nbytes(self) -> int:
        return self.source.numel * self.dtype.itemsize


@dataclass
class OutFile:
    """One output ``model-K-of-F.safetensors``: its tensors in file order, header and total size."""

    name: str
    tensors: list[OutTensor] = field(default_factory=list)
    header: bytes = b""

    def lay_out(self) -> None:
        """Order tensors as safetensors does, encode the header and assign every tensor's byte offset."""
        by_key = {(t.name, st_dtype_name(t.dtype)): t for t in self.tensors}
        self.tensors = [by_key[k] for k in layout_order(list(by_key))]
        entries = [(t.name, st_dtype_name(t.dtype), t.source.shape, t.nbytes) for t in self.tensors]
        self.header = encode_header(entries, _HEADER_METADATA)
        offset = len(self.header)
        for t in self.tensors:
            t.offset = offset
            offset += t.nbytes

    @property
    def size(self) -> int:
        return len(self.header) + sum(t.nbytes for t in self.tensors)


def write_files(files: list[OutFile], folder: Path, num_threads: int, advance: Callable[[int], None]) -> None:
    """Write ``files`` into ``folder`` with ``num_threads`` threads; each file is fsynced once, at the end."""
    if files:
        with _threads(num_threads), _Writer(num_threads, advance) as writer:
            writer.run(files, folder)


@dataclass
class Write:
    """One positioned write: ``run()`` puts bytes ``[start, start + size)`` of the destination in place."""

    start: int
    size: int
    run: Callable[[], None]


@contextmanager
def writes_into(placed: list[tuple[OutFile, int]], fd: int, num_threads: int, advance: Callable[[int], None]
                ) -> Iterator[tuple[list[Write], Callable[[list[Write]], None]]]:
    """The writes that put each ``(file, start)`` into ``fd`` from its byte ``start`` on, in the order of their
    bytes, and the function that runs a batch of them on ``num_threads`` threads: a caller that streams the file
    runs them a stretch of bytes at a time. Each is at most a copy chunk, or one tensor assembled in memory."""
    with _threads(num_threads), _Writer(num_threads, advance) as writer:
        tensors = [(fd, replace(t, offset=t.offset + start)) for f, start in placed for t in f.tensors]
        writer.size_budget(tensors)
        writes = [Write(start, len(f.header), lambda f=f, start=start: pwrite_all(fd, f.header, start))
                  for f, start in placed]
        writes += [w for dst, t in tensors for w in writer.writes(dst, t)]
        yield sorted(writes, key=lambda w: w.start), lambda batch: writer.run_all([w.run for w in batch])


@contextmanager
def _threads(num_threads: int) -> Iterator[None]:
    intra_op = torch.get_num_threads()
    if num_threads > 1:
        torch.set_num_threads(1)  # our threads already run conversions in parallel; nested pools only contend
    try:
        yield
    finally:
        torch.set_num_threads(intra_op)


class _Budget:
    """Caps the bytes of tensors assembled in memory at once; one tensor larger than the cap still proceeds alone."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.used = 0
        self.cond = threading.Condition()

    def acquire(self, n: int) -> None:
        with self.cond:
            while self.used and self.used + n > self.cap:
                self.cond.wait()
            self.used += n

    def release(self, n: int) -> None:
        with self.cond:
            self.used -= n
            self.cond.notify_all()


def kernel_copy(src: int, dst: int, src_pos: int, dst_pos: int, nbytes: int,
                advance: Callable[[int], None] = lambda n: None, changed: str = "a source file changed") -> bool:
    """Copy ``nbytes`` between two files inside the kernel, ``advance`` told each step; False (nothing copied) where
    the filesystem pair does not support it. A source that ends early changed under us: ``changed`` is raised."""
    done = 0
    try:
        while done < nbytes and hasattr(os, "copy_file_range"):
            n = os.copy_file_range(src, dst, min(_COPY_CHUNK, nbytes - done), src_pos + done, dst_pos + done)
            if n == 0:
                raise CheckpointError(changed)
            done += n
            advance(n)
    except OSError as e:
        if e.errno in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF) and done == 0:
            return False
        raise
    return done == nbytes


class _Writer:
    def __init__(self, num_threads: int, advance: Callable[[int], None]) -> None:
        self.num_threads = max(1, num_threads)
        self.advance = advance
        self.src_fds: dict[Path, int] = {}
        self.dst_fds: dict[str, int] = {}
        self.lock = threading.Lock()
        self.local = threading.local()
        self.kernel_copy = True
        self.budget = _Budget(_MIN_ASSEMBLY_BUDGET)

    def __enter__(self) -> _Writer:
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in [*self.src_fds.values(), *self.dst_fds.values()]:
            os.close(fd)

    # ------------------------------------------------------------------------------------------ driver
    def run(self, files: list[OutFile], folder: Path) -> None:
        for f in files:
            path = folder / f.name
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                self.dst_fds[f.name] = fd
                os.ftruncate(fd, f.size)
                pwrite_all(fd, f.header, 0)
            except OSError as e:
                raise CheckpointError(f"cannot write {path}: {e.strerror or e}") from None
        tensors = [(self.dst_fds[f.name], t) for f in files for t in f.tensors]
        self.size_budget(tensors)
        self.run_all([w.run for dst, t in tensors for w in self.writes(dst, t)])
        self.run_all([lambda fd=fd, name=name: self._fsync(fd, folder / name) for name, fd in self.dst_fds.items()])

    def size_budget(self, tensors: list[tuple[int, OutTensor]]) -> None:
        """Room for the largest tensor that is assembled in memory."""
        assembled = [t.nbytes for _, t in tensors if not _streamable(t.source)]
        self.budget.cap = max([_MIN_ASSEMBLY_BUDGET, *assembled])

    def run_all(self, tasks: list[Callable[[], None]]) -> None:
        if self.num_threads == 1 or len(tasks) == 1:
            for task in tasks:
                task()
            return
        with ThreadPoolExecutor(self.num_threads, thread_name_prefix="consolidate") as pool:
            futures = [pool.submit(task) for task in tasks]
            done, pending = wait(futures, return_when=FIRST_EXCEPTION)
            for fut in pending:
                fut.cancel()
            for fut in futures:
                if fut.done() and not fut.cancelled() and fut.exception() is not None:
                    raise fut.exception()  # type: ignore[misc]

    def _fsync(self, fd: int, path: Path) -> None:
        try:
            os.fsync(fd)
        except OSError as e:
            raise CheckpointError(f"cannot write {path}: {e.strerror or e}") from None

    def writes(self, dst: int, out: OutTensor) -> Iterator[Write]:
        """The writes of one tensor's bytes into ``dst``."""
        src = out.source
        if not _streamable(src):
            yield Write(out.offset, out.nbytes, lambda: self._assemble(dst, out))
            return
        strides = c_strides(tuple(src.shape))
        size = out.dtype.itemsize
        for piece in src.pieces:
            if piece.numel == 0:
                continue
            start = sum(o * s for o, s in zip(piece.offsets, strides))
            if not piece.raw:
                yield Write(out.offset + start * size, piece.numel * size,
                            lambda piece=piece, start=start: self._write_loaded(dst, out, piece, start))
                continue
            step = (_COPY_CHUNK if src.dtype == out.dtype else _CONVERT_CHUNK) // src.dtype.itemsize
            for first in range(0, piece.numel, step):
                count = min(step, piece.numel - first)
                yield Write(out.offset + (start + first) * size, count * size,
                            lambda piece=piece, first=first, count=count, start=start: self._copy(
                                dst, out, piece, first, count, start + first))

    # ------------------------------------------------------------------------------------------ tasks
    def _copy(self, dst: int, out: OutTensor, piece: Piece, first: int, count: int, elem: int) -> None:
        """Elements ``[first, first + count)`` of a raw piece to output element ``elem`` of its tensor."""
        src_dtype = out.source.dtype
        src_pos = piece.start + first * src_dtype.itemsize
        dst_pos = out.offset + elem * out.dtype.itemsize
        nbytes = count * src_dtype.itemsize
        fd = self._src_fd(piece.file)
        if src_dtype == out.dtype:
            self.kernel_copy = self.kernel_copy and kernel_copy(
                fd, dst, src_pos, dst_pos, nbytes, changed=f"'{piece.file}' ended early: it changed while it was read")
            if not self.kernel_copy:  # stop trying once the filesystem pair refused
                with _mapped(fd, src_pos, count, src_dtype) as values:
                    pwrite_all(dst, bytes_of(values), dst_pos)
        else:
            converted = self._out_buffer(out.dtype, count)
            with _mapped(fd, src_pos, count, src_dtype) as values:
                converted.copy_(values)  # converts straight from the page cache: no intermediate copy
            pwrite_all(dst, bytes_of(converted), dst_pos)
        self._written(dst, dst_pos, count * out.dtype.itemsize)

    def _write_loaded(self, dst: int, out: OutTensor, piece: Piece, elem: int) -> None:
        tensor = load_dcp_piece(piece).to(out.dtype).reshape(-1)
        pos = out.offset + elem * out.dtype.itemsize
        pwrite_all(dst, bytes_of(tensor), pos)
        self._written(dst, pos, tensor.numel() * out.dtype.itemsize)

    def _assemble(self, dst: int, out: OutTensor) -> None:
        """Build the whole tensor in memory from pieces that are not contiguous in it, then write it."""
        src = out.source
        nbytes = max(out.nbytes, math.prod(src.base_shape or src.shape) * src.dtype.itemsize)
        self.budget.acquire(nbytes)
        try:
            full = read_full(src, self._copy_mapped)  # a strided part of a saved tensor: see export/views.py
            pwrite_all(dst, bytes_of(full.to(out.dtype).reshape(-1)), out.offset)
            self._written(dst, out.offset, out.nbytes)
        finally:
            self.budget.release(nbytes)

    def _copy_mapped(self, region: torch.Tensor, piece: Piece) -> None:
        with _mapped(self._src_fd(piece.file), piece.start, piece.numel, region.dtype) as values:
            region.copy_(values.view(piece.shape))

    # ------------------------------------------------------------------------------------------ helpers
    def _written(self, fd: int, offset: int, nbytes: int) -> None:
        start_writeback(fd, offset, nbytes)
        self.advance(nbytes)

    def _src_fd(self, path: Path) -> int:
        with self.lock:
            fd = self.src_fds.get(path)
            if fd is None:
                try:
                    fd = self.src_fds[path] = open_regular(path)  # never through a link, never a FIFO
                except FileNotFoundError:
                    raise CheckpointError(f"missing shard file {path}") from None
                except OSError as exc:
                    raise CheckpointError(f"cannot read shard file {path}: {first_line(exc)}") from None
        return fd

    def _out_buffer(self, dtype: torch.dtype, count: int) -> torch.Tensor:
        """A per-thread reusable tensor of ``count`` elements: fresh pages are costly, reused ones are not."""
        bufs = self.local.__dict__.setdefault("out", {})
        buf = bufs.get(dtype)
        if buf is None or buf.numel() < count:
            buf = bufs[dtype] = torch.empty(max(count, _CONVERT_CHUNK // dtype.itemsize), dtype=dtype)
        return buf[:count]


@contextmanager
def _mapped(fd: int, offset: int, count: int, dtype: torch.dtype) -> Iterator[torch.Tensor]:
    """``count`` values at byte ``offset`` of a file, as a tensor over a copy-on-write mapping of just that range
    (no copy out of the page cache, resident memory bounded); it must not be used after the block."""
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    with mmap.mmap(fd, offset + count * dtype.itemsize - start, offset=start, access=mmap.ACCESS_COPY) as mm:
        yield torch.frombuffer(mm, dtype=dtype, count=count, offset=offset - start)


def _streamable(tensor: SourceTensor) -> bool:
    """Whether every piece is one contiguous run of the full tensor (true for row-split FSDP shards)."""
    return tensor.view is None and all(flat_range(p, tensor.shape) is not None for p in tensor.pieces if p.numel)


def bytes_of(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    flat = tensor.contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


def total_bytes(files: list[OutFile]) -> int:
    return sum(math.prod(t.source.shape) * t.dtype.itemsize for f in files for t in f.tensors)
