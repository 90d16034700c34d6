"""DCP storage readers that read tensor bytes with ``preadv`` straight into the tensors being loaded."""

from __future__ import annotations

import functools
import io
import os
from pathlib import Path
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from automodel_ckpt.distributed.dcp_private import StorageInfo
from automodel_ckpt.ondisk.paths import open_regular
from automodel_ckpt.ondisk.fastio import common, directread, session
from automodel_ckpt.ondisk.fastio.common import BYTES_READ, READ_THREADS, ST_CODES, Located, default_threads, itemsize, tensor_memory
from automodel_ckpt.ondisk.fastio.records import locate_record, noted_location
from automodel_ckpt.ondisk.formats.safe_load import CachingHFReader, SafeFileSystemReader
from automodel_ckpt.ondisk.formats.safetensors_io import header_at, pread_full

def contiguous_range(shape: tuple[int, ...], offsets: tuple[int, ...], lengths: tuple[int, ...]) -> tuple[int, int] | None:
    """``(first element, count)`` when piece ``offsets``/``lengths`` of ``shape`` is one contiguous run, else None."""
    starts, run = runs(shape, offsets, lengths)
    return (starts[0], run) if len(starts) == 1 else None


def _pread_into(fd: int, view: memoryview, offset: int) -> None:
    n = pread_full(fd, view, offset)
    BYTES_READ.add(n)
    if n < view.nbytes:
        raise OSError(f"unexpected end of file at byte {offset + n}")


def runs(shape: tuple[int, ...], offsets: tuple[int, ...], lengths: tuple[int, ...]) -> tuple[list[int], int]:
    """``(first elements, run length)``: piece ``offsets``/``lengths`` of ``shape`` as runs of consecutive elements."""
    if not shape:
        return [0], 1
    j = len(shape) - 1
    while j > 0 and offsets[j] == 0 and lengths[j] == shape[j]:
        j -= 1
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    starts = [offsets[j] * strides[j]]
    for i in range(j - 1, -1, -1):  # every index of the outer dimensions, the last one varying fastest
        starts = [(offsets[i] + k) * strides[i] + s for k in range(lengths[i]) for s in starts]
    return starts, lengths[j] * strides[j]


class ReadJob:
    """One request: the saved piece read straight into the destination, or via a buffer and ``copy_``
    (``located`` None: an unrecognised record, loaded by ``torch.load`` as torch's reader does)."""

    def __init__(self, path: str, located: Located | None, offsets: tuple[int, ...], lengths: tuple[int, ...],
                 target: torch.Tensor, record: tuple[int, int] | None = None) -> None:
        self.path, self.located, self.offsets, self.lengths, self.target = path, located, offsets, lengths, target
        self.record = record
        self.direct = self.in_place = False
        self.runs: list[tuple[int, int]] | None = None
        if located is None:
            self.start, self.nbytes = record
            return
        size_of = itemsize(located.dtype)
        starts, run = runs(located.shape, offsets, lengths)
        # the saved bytes are the target's own: read into it (on the CPU), or copied into it from the read buffer
        self.in_place = (len(starts) == 1 and target.is_contiguous() and target.dtype == located.dtype
                         and tuple(target.shape) == tuple(lengths))
        self.direct = self.in_place and target.device.type == "cpu"
        self.start = located.offset + starts[0] * size_of
        self.nbytes = len(starts) * run * size_of
        if len(starts) > 1:  # several runs (a block of columns, ...): only their bytes are read, run by run
            self.runs = [(located.offset + first * size_of, run * size_of) for first in starts]

    def tasks(self) -> list[tuple[int, int, Callable[[int], None]]]:
        """``(file offset, bytes, read(fd))``: a direct read in ``common.CHUNK`` pieces, else one task."""
        if not self.direct:
            return [(self.start, self.nbytes, self.read_copy)]
        return [(self.start + s, min(common.CHUNK, self.nbytes - s), functools.partial(self.read_direct, s=s))
                for s in range(0, self.nbytes, common.CHUNK)] or [(self.start, 0, lambda fd: None)]

    def read_direct(self, fd: int, s: int) -> None:
        n = min(common.CHUNK, self.nbytes - s)
        _pread_into(fd, tensor_memory(self.target, writable=True)[s:s + n], self.start + s)

    def segment(self) -> directread.Segment | None:
        """This job as bytes of its file to copy into place (``directread``); None: an unrecognised record."""
        if self.located is None or self.runs is not None:
            return None
        if self.in_place:
            return directread.Segment(self.start, self.target.reshape(-1).view(torch.uint8))
        dtype = self.located.dtype
        buffer: list[torch.Tensor] = []

        def make() -> torch.Tensor:
            buffer.append(common.scratch(self.nbytes // itemsize(dtype), dtype))
            return buffer[0].view(-1).view(torch.uint8)

        return directread.Segment(self.start, nbytes=self.nbytes, make=make, done=lambda: self._place(buffer.pop()))

    def read_copy(self, fd: int) -> None:
        if self.located is None:
            self._read_record(fd)
            return
        buffer = common.scratch(self.nbytes // itemsize(self.located.dtype), self.located.dtype)
        memory = tensor_memory(buffer, writable=True)
        if self.runs is None:
            _pread_into(fd, memory, self.start)
        else:
            done = 0
            for start, n in self.runs:
                _pread_into(fd, memory[done:done + n], start)
                done += n
        self._place(buffer)

    def _place(self, buffer: torch.Tensor) -> None:
        self._copy(buffer.view(tuple(self.lengths)))

    def _read_record(self, fd: int) -> None:
        from torch.distributed._shard._utils import narrow_tensor_by_index

        data = bytearray(self.nbytes)
        _pread_into(fd, memoryview(data), self.start)
        tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        self._copy(narrow_tensor_by_index(tensor, self.offsets, self.lengths))

    def _copy(self, piece: torch.Tensor) -> None:
        if tuple(self.target.shape) != tuple(piece.shape):
            raise AssertionError(f"size mismatch: {tuple(self.target.shape)} vs {tuple(piece.shape)}")
        self.target.copy_(piece)


def _split_even(tasks: list[tuple[str, int, int, Any]], groups: int) -> list[list[tuple[str, int, int, Any]]]:
    """Consecutive runs of ``tasks`` (sorted by file and offset) of about equal bytes: one per thread."""
    total = sum(t[2] for t in tasks) or 1
    out: list[list[tuple[str, int, int, Any]]] = [[]]
    done = 0
    for task in tasks:
        if out[-1] and done >= total * len(out) / groups and len(out) < groups:
            out.append([])
        out[-1].append(task)
        done += task[2]
    return out


def _in_threads(groups: list[list[Any]], work: Callable[[list[Any]], None]) -> None:
    if len(groups) == 1:
        work(groups[0])
        return
    with session.pool(len(groups)) as pool:
        for f in [pool.submit(work, g) for g in groups]:
            f.result()


def _open_fd(path: str, advice: int | None) -> int:
    fd = open_regular(Path(path), follow=True)  # never a FIFO or device (a base's cache links are followed)
    if advice is not None and hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, advice)
    return fd


def run_reads(jobs: list[ReadJob], threads: int, hash_files: dict[str, Any] | None = None,
              on_hashed: Callable[[], None] | None = None, gap: int = directread.GAP) -> None:
    """Every job's bytes: large files and files to hash past the page cache (``directread``), the rest with
    ``preadv``, each thread one consecutive stretch (the kernel reads ahead). ``on_hashed``: called once the
    hashed files are read, before anything else may fail (so a damaged record's checksum tells first)."""
    hash_files = {os.path.realpath(p): h for p, h in (hash_files or {}).items()}
    sizes: dict[str, int] = {}
    real: dict[str, str] = {}
    for job in jobs:
        if job.path not in real:
            real[job.path] = os.path.realpath(job.path)
            sizes[real[job.path]] = os.stat(job.path).st_size
    regions = {p for p, n in sizes.items() if p in hash_files or directread.wanted(n)}
    segments: dict[str, list[directread.Segment]] = {}
    rest = []
    for job in jobs:
        segment = job.segment() if real[job.path] in regions else None
        if segment is None:
            rest.append(job)
        else:
            segments.setdefault(real[job.path], []).append(segment)
    if segments or hash_files:
        directread.read_files(segments, threads, sizes=sizes, hash_files=hash_files, gap=gap)
        if on_hashed is not None:
            on_hashed()
    _preadv_reads(rest, threads)


def _preadv_reads(jobs: list[ReadJob], threads: int) -> None:
    tasks = sorted(((job.path, start, n, read) for job in jobs for start, n, read in job.tasks()),
                   key=lambda t: (t[0], t[1]))
    if not tasks:
        return

    def work(group: list[tuple[str, int, int, Any]]) -> None:
        _each_with_fd(group, getattr(os, "POSIX_FADV_SEQUENTIAL", None), lambda fd, task: task[3](fd))

    _in_threads(_split_even(tasks, max(1, min(threads, len(tasks)))), work)


def _each_with_fd(group: list[tuple[Any, ...]], advice: int | None, use: Callable[[int, tuple], None]) -> None:
    """``use(fd, item)`` for every item of ``group`` (its path first), each file opened once."""
    fds: dict[str, int] = {}
    try:
        for item in group:
            if item[0] not in fds:
                fds[item[0]] = _open_fd(item[0], advice)
            use(fds[item[0]], item)
    finally:
        for fd in fds.values():
            os.close(fd)


def _finish_reads(reqs_targets: list[tuple[Any, torch.Tensor]], planner: LoadPlanner) -> Future:
    for req, target in reqs_targets:
        planner.commit_tensor(req, target)
    fut: Future = Future()
    fut.set_result(None)
    return fut


# safetensors --------------------------------------------------------------------------------------


def read_safetensors(reader: Any, plan: LoadPlan, planner: LoadPlanner, threads: int,
                     hash_files: dict[str, Any] | None = None, on_hashed: Any = None) -> Future | None:
    """``HuggingFaceStorageReader.read_data`` with ``preadv`` into the destinations; None: use torch's instead."""
    headers: dict[str, tuple[int, dict[str, Any]]] = {}
    jobs, done = [], []
    for req in plan.items:
        path = str(reader.storage_data[req.storage_index].relative_path)
        if path not in headers:
            headers[path] = reader.header(path)
        file, start, header = headers[path]
        entry = header.get(req.storage_index.fqn)
        if entry is None or entry.get("dtype") not in ST_CODES:
            return None
        located = Located(start + entry["data_offsets"][0], tuple(entry["shape"]), ST_CODES[entry["dtype"]])
        target = planner.resolve_tensor(req).detach()
        jobs.append(ReadJob(file, located, tuple(req.storage_offsets), tuple(req.lengths), target))
        done.append((req, target))
    run_reads(jobs, threads, hash_files, on_hashed, gap=getattr(reader, "gap", directread.GAP))
    return _finish_reads(done, planner)


def _read_distcp(reader: Any, plan: LoadPlan, planner: LoadPlanner, threads: int,
                hash_files: dict[str, Any] | None = None, on_hashed: Any = None) -> Future | None:
    """``FileSystemReader.read_data`` with the records located (from ``records.NOTE``, else their zip entries)
    and read as ``read_safetensors`` reads; other records through ``torch.load``; None: use torch's instead."""
    items = []
    located: dict[int, Located | None] = {}
    for req in plan.items:
        info: StorageInfo = reader.storage_data[req.storage_index]
        if info.transform_descriptors:
            return None
        items.append((str(Path(reader.path) / info.relative_path), info.offset, info.length, req))
        if req.type != LoadItemType.BYTE_IO:
            noted = noted_location(info, tuple(req.storage_offsets), tuple(req.lengths))
            if noted is not None:
                located[id(req)] = noted
    items.sort(key=lambda t: (t[0], t[1]))
    tensors = [it for it in items if it[3].type != LoadItemType.BYTE_IO]
    unknown = [it for it in tensors if id(it[3]) not in located]

    def locate(group: list[tuple[str, int, int, Any]]) -> None:
        def one(fd: int, item: tuple[str, int, int, Any]) -> None:
            located[id(item[3])] = locate_record(fd, item[1], item[2])

        _each_with_fd(group, getattr(os, "POSIX_FADV_RANDOM", None), one)

    if unknown:  # records of another writer: a few small reads each
        _in_threads(_split_even(unknown, max(1, min(threads, len(unknown)))), locate)
    jobs, done = [], []
    for path, offset, length, req in tensors:
        target = planner.resolve_tensor(req).detach()
        jobs.append(ReadJob(path, located[id(req)], tuple(req.storage_offsets), tuple(req.lengths), target,
                             record=(offset, length)))
        done.append((req, target))
    for path, offset, length, req in items:
        if req.type == LoadItemType.BYTE_IO:
            fd = _open_fd(path, None)
            try:
                data = os.pread(fd, length, offset)
            finally:
                os.close(fd)
            if len(data) != length:
                raise OSError(f"unexpected end of file in '{path}'")
            planner.load_bytes(req, io.BytesIO(data))
    run_reads(jobs, threads, hash_files, on_hashed)
    return _finish_reads(done, planner)


class _Checked:
    """A reader's optional ``check`` (``loadcheck.LoadCheck``): the folder's files of its share hashed while read."""

    check: Any = None

    def _read(self, read: Callable[..., Future | None], plan: LoadPlan, planner: LoadPlanner) -> Future:
        hashers: dict[str, Any] = {}
        if self.check is not None:  # the files this load reads from
            data = self.storage_data  # type: ignore[attr-defined]
            reading = {os.path.join(self.path, data[req.storage_index].relative_path) for req in plan.items}
            hashers = self.check.hashers(Path(self.path), reading)
        # a mismatch is raised in read_data: every rank learns of it through DCP
        done = read(self, plan, planner, self.threads, hashers, (lambda: self.check.check(hashers)) if hashers else None)
        if done is None:  # torch's reader: the files are hashed at the end of the load instead
            return super().read_data(plan, planner)  # type: ignore[misc]
        return done


class ParallelHFReader(_Checked, CachingHFReader):
    """``CachingHFReader`` whose reads go straight into the destination tensors (``gap``: see ``directread``)."""

    def __init__(self, path: str | os.PathLike, *, threads: int = READ_THREADS, check: Any = None,
                 gap: int = directread.GAP) -> None:
        super().__init__(str(path))
        self.threads = default_threads(threads)
        self.check = check
        self.gap = gap

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        return self._read(read_safetensors, plan, planner)

    def header(self, path: str) -> tuple[str, int, dict[str, Any]]:
        """``(file to read, data start, header)`` of the safetensors file ``path`` names (an archive overrides it)."""
        fd = _open_fd(path, getattr(os, "POSIX_FADV_RANDOM", None))
        try:
            header, start = header_at(fd, path)
        finally:
            os.close(fd)
        return path, start, header


class ParallelFileSystemReader(_Checked, SafeFileSystemReader):
    """``SafeFileSystemReader`` whose reads go straight into the destination tensors (``_read_distcp``)."""

    def __init__(self, path: str | os.PathLike, *, threads: int = READ_THREADS, check: Any = None) -> None:
        super().__init__(str(path))
        self.threads = default_threads(threads)
        self.check = check

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        return self._read(_read_distcp, plan, planner)
