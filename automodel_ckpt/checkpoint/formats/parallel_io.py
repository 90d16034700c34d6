"""Parallel, zero-copy reads and writes of the model and optimizer files, in the formats torch's own DCP writers use.

Each rank still writes exactly one file per state folder (``__R_0.distcp`` or ``shard-0000R-model-00001-of-00001
.safetensors``), byte-compatible with ``FileSystemReader`` / ``HuggingFaceStorageReader``, ``dcp_to_torch_save``
and ``safetensors``; what changes is how the bytes get there:

* Writes. The file's layout (every record's offset) is planned first, then the bytes go from the tensors' own
  memory straight to the file with positioned writes (``pwritev``) from ``threads`` threads, in chunks of
  ``CHUNK``; no serialized copy of the state is built (torch's safetensors writer builds one of the whole shard).
  Writeback of each chunk is started as soon as it is written (``sync_file_range`` on Linux), so the disk works
  while later chunks are copied; one ``fsync`` at the end makes the file durable. The checksum the manifest needs
  is computed from the same memory while the file is written, so sealing the checkpoint does not read it back.
  A ``torch_save`` record is what ``torch.save`` writes for the tensor (zip archive, pickled tensor metadata), but
  without torch's zip CRC-32 (the manifest's checksum covers the file; ``torch.load`` does not check the CRC).
* Reads. The tensor bytes are located in the file (safetensors header, or the torch.save record's zip entry) and
  read with ``preadv`` directly into the destination tensor's memory when the requested piece is one contiguous
  byte range of it (always, when the world size did not change); otherwise into a buffer and copied.
* Optimizer state is materialised for loading without running an optimizer step (``init_optimizer_state``).

Anything unusual (stream transforms, tensors of an unknown dtype, non-CPU destinations, a record this module does not
recognise) takes torch's own code path for that item, so this module never changes what can be saved or loaded.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import inspect
import io
import json
import os
import pickle
import struct
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch.distributed.checkpoint import FileSystemWriter, HuggingFaceStorageWriter
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from automodel_ckpt.checkpoint import storage

CHUNK = 32 << 20  # bytes per positioned write or read, and per writeback request
WRITE_THREADS = 4  # per rank
READ_THREADS = 4  # per rank
_SMALL = 1 << 20  # pieces below this are coalesced into one buffer before writing


def _default_threads(wanted: int) -> int:
    return max(1, min(wanted, 2 * (os.cpu_count() or 1)))


# --- raw memory ------------------------------------------------------------------------------------


def _tensor_memory(t: torch.Tensor, writable: bool = False) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (the caller keeps ``t`` alive while using them)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    view = memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")
    return view if writable else view.toreadonly()


# --- writeback ---------------------------------------------------------------------------------------

_SYNC_FILE_RANGE_WRITE = 2


def _load_sync_file_range() -> Callable[[int, int, int], None] | None:
    if not hasattr(os, "sched_getaffinity"):  # Linux only
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return lambda fd, offset, nbytes: fn(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


_start_writeback = _load_sync_file_range()


# --- writing one file --------------------------------------------------------------------------------


class _Lazy:
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
        return t, _tensor_memory(t)


Piece = "bytes | memoryview | _Lazy"


def _length(piece: Any) -> int:
    return piece.nbytes if isinstance(piece, (_Lazy, memoryview)) else len(piece)


@dataclasses.dataclass
class _Unit:
    """One positioned write: consecutive pieces (or part of one large piece) at ``offset``."""

    offset: int
    parts: list[tuple[Any, int, int]]  # (piece, start, stop) within the piece


def _units(pieces: list[Any]) -> Iterator[_Unit]:
    """Split the file into writes of about ``CHUNK`` bytes: small pieces together, large ones in slices."""
    offset = 0
    pending: list[tuple[Any, int, int]] = []
    pending_at, pending_len = 0, 0
    for piece in pieces:
        n = _length(piece)
        if n == 0:
            continue
        if n < _SMALL and pending_len + n <= CHUNK:
            if not pending:
                pending_at = offset
            pending.append((piece, 0, n))
            pending_len += n
            offset += n
            continue
        if pending:
            yield _Unit(pending_at, pending)
            pending, pending_len = [], 0
        if isinstance(piece, _Lazy) and not piece.direct:  # materialised once, by the one write of it
            yield _Unit(offset, [(piece, 0, n)])
            offset += n
            continue
        for start in range(0, n, CHUNK):
            stop = min(n, start + CHUNK)
            yield _Unit(offset + start, [(piece, start, stop)])
        offset += n
    if pending:
        yield _Unit(pending_at, pending)


def _pwrite_all(fd: int, buffers: list[memoryview], offset: int) -> None:
    while buffers:
        written = os.pwritev(fd, buffers, offset) if len(buffers) > 1 else os.pwrite(fd, buffers[0], offset)
        offset += written
        while buffers and written >= buffers[0].nbytes:
            written -= buffers[0].nbytes
            buffers.pop(0)
        if buffers and written:
            buffers[0] = buffers[0][written:]


class _Hasher:
    """The file's checksum (the manifest's algorithm), fed with its bytes in file order from a thread of its own."""

    def __init__(self) -> None:
        from automodel_ckpt.checkpoint import manifest

        self.algorithm = manifest.default_algorithm()
        self._h = manifest._hasher(self.algorithm)
        self.ok = False

    def feed(self, pieces: list[Any]) -> None:
        try:
            self._feed(pieces)
            self.ok = True
        except Exception:  # noqa: BLE001 - no checksum then: the manifest reads the file instead
            self.ok = False

    def _feed(self, pieces: list[Any]) -> None:
        for piece in pieces:
            if isinstance(piece, _Lazy):
                _, view = piece.materialise()  # direct pieces only: a view, no copy
            else:
                view = memoryview(piece).cast("B") if not isinstance(piece, memoryview) else piece
            for start in range(0, view.nbytes, 8 << 20):
                self._h.update(view[start:start + (8 << 20)])

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def write_file(path: Path, pieces: list[Any], threads: int) -> int:
    """Write ``pieces`` back to back into ``path`` (created or truncated) and fsync it; returns its size.

    Records the file as synced, with its checksum, for ``fsync_tree`` and the manifest (``storage.note_written``).
    """
    path = Path(path)
    total = sum(_length(p) for p in pieces)
    hash_now = all(not isinstance(p, _Lazy) or p.direct for p in pieces)  # else the manifest reads it back
    hasher = _Hasher() if hash_now else None
    hash_thread = threading.Thread(target=hasher.feed, args=(pieces,), daemon=True) if hasher else None
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        if hash_thread is not None:
            hash_thread.start()

        def write(unit: _Unit) -> None:
            keep = []
            views = []
            for piece, start, stop in unit.parts:
                if isinstance(piece, _Lazy):
                    t, view = piece.materialise()
                    keep.append(t)
                else:
                    view = memoryview(piece).cast("B") if not isinstance(piece, memoryview) else piece
                views.append(view[start:stop])
            _pwrite_all(fd, views, unit.offset)
            if _start_writeback is not None:
                _start_writeback(fd, unit.offset, sum(v.nbytes for v in views))

        units = list(_units(pieces))
        if threads > 1 and len(units) > 1:
            with ThreadPoolExecutor(min(threads, len(units)), thread_name_prefix="ckpt-write") as pool:
                for f in [pool.submit(write, u) for u in units]:
                    f.result()
        else:
            for u in units:
                write(u)
        os.fsync(fd)
    finally:
        os.close(fd)
        if hash_thread is not None:
            hash_thread.join()
    if hasher is not None and hasher.ok:
        storage.note_written(path, synced=True, algorithm=hasher.algorithm, digest=hasher.hexdigest())
    else:
        storage.note_written(path, synced=True)
    return total


# --- torch.save records ------------------------------------------------------------------------------


class _Recorder:
    """A write-only file object that keeps what ``torch.save`` writes: small writes copied, the storage by address."""

    def __init__(self, keep_at: int) -> None:
        self.keep_at = keep_at  # the storage's address: that write is kept by reference, not copied
        self.parts: list[tuple[int, bytes | None, int]] = []  # (address, bytes or None, length)

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = view.nbytes
        address = _address(view) if n else 0
        self.parts.append((address, None if address == self.keep_at else view.tobytes(), n))
        return n

    def flush(self) -> None:
        pass


def _address(view: memoryview) -> int:
    import numpy as np

    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


_TEMPLATES: dict[tuple, list[bytes | None]] = {}
_TEMPLATES_LOCK = threading.Lock()


def _record_template(shape: torch.Size, dtype: torch.dtype) -> list[bytes | None] | None:
    """What ``torch.save`` writes for a contiguous CPU tensor of ``shape`` and ``dtype``, with ``None`` where its
    data goes; None when it cannot be found. The same for every tensor of that shape and dtype (no CRC), so cached.
    """
    key = (tuple(shape), dtype)
    with _TEMPLATES_LOCK:
        if key in _TEMPLATES:
            return _TEMPLATES[key]
    stand_in = torch.empty(shape, dtype=dtype)  # pages never touched: costs no memory
    nbytes = stand_in.numel() * stand_in.element_size()
    recorder = _Recorder(stand_in.data_ptr() if nbytes else -1)
    try:
        writer = torch._C.PyTorchFileWriter(recorder, False, torch.serialization._get_storage_alignment())
        torch.serialization._save(stand_in, writer, pickle, torch.serialization.DEFAULT_PROTOCOL, False)
        writer.write_end_of_file()
    except (AttributeError, TypeError, RuntimeError):  # torch's internals moved: no template, torch's path
        return None
    template: list[bytes | None] = []
    found = nbytes == 0
    small = bytearray()
    for _address_, data, n in recorder.parts:
        if data is None:
            if found or n != nbytes:
                return None  # the storage written twice, or in parts: unexpected
            if small:
                template.append(bytes(small))
                small = bytearray()
            template.append(None)
            found = True
        else:
            small += data
    if small:
        template.append(bytes(small))
    if not found:
        return None
    with _TEMPLATES_LOCK:
        _TEMPLATES[key] = template
    return template


def _torch_save_pieces(tensor: torch.Tensor) -> list[Any] | None:
    if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_sparse or type(tensor) is not torch.Tensor:
        return None
    template = _record_template(tensor.shape, tensor.dtype)
    if template is None:
        return None
    return [_Lazy(tensor) if part is None else part for part in template]


def _torch_save_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


# --- writers -----------------------------------------------------------------------------------------


def _done(results: list[WriteResult]) -> Future:
    fut: Future = Future()
    fut.set_result(results)
    return fut


class ParallelFileSystemWriter(FileSystemWriter):
    """``FileSystemWriter`` (DCP ``.distcp`` files, one per rank) written by ``write_file``.

    ``sync_files`` stays on for the ``.metadata`` file torch writes itself; the data file is fsynced once by
    ``write_file``.
    """

    def __init__(self, path: str | os.PathLike, *, threads: int = WRITE_THREADS) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1)
        self.threads = _default_threads(threads)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        if self.transforms.extensions or not self.single_file_per_rank:
            return super().write_data(plan, planner)
        file_name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
        pieces: list[Any] = []
        results: list[WriteResult] = []
        offset = 0
        items = [wi for wi in plan.items if wi.type == WriteItemType.BYTE_IO]
        items += [wi for wi in plan.items if wi.type != WriteItemType.BYTE_IO]
        for item in items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                record = [bytes(data.getbuffer())]
            else:
                tensor = data.detach()
                record = _torch_save_pieces(tensor) or [_torch_save_bytes(_compact(tensor))]
            length = sum(_length(p) for p in record)
            pieces += record
            results.append(WriteResult(index=item.index, size_in_bytes=length,
                                       storage_data=_StorageInfo(file_name, offset, length)))
            offset += length
        write_file(Path(self.fs.concat_path(self.path, file_name)), pieces, self.threads)
        return _done(results)

    def finish(self, metadata: Any, results: list[list[WriteResult]]) -> None:
        super().finish(metadata, results)  # runs where the .metadata file is written (and fsynced)
        path = Path(self._get_metadata_path(None if self.use_collectives else self.rank))
        if path.is_file():
            storage.note_written(path, synced=self.sync_files)


def _compact(tensor: torch.Tensor) -> torch.Tensor:
    """What torch's writer saves: the tensor on the CPU, with a storage of its own size."""
    t = tensor.cpu()
    return t.clone() if t.untyped_storage().size() != t.numel() * t.element_size() else t


_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("uint16", "U16"),
                     ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):
        _ST_DTYPES[getattr(torch, _name)] = _code
_ST_CODES = {code: dtype for dtype, code in _ST_DTYPES.items()}


class ParallelSafetensorsWriter(HuggingFaceStorageWriter):
    """``HuggingFaceStorageWriter(save_distributed=True)``: one safetensors shard per rank, written by ``write_file``.

    The shard holds the same header (tensor names, shapes, dtypes, ``DCP_SHARDING_INFO`` offsets) as torch's
    writer produces, tensors ordered by alignment then name as ``safetensors`` orders them.
    """

    def __init__(self, path: str | os.PathLike, *, threads: int = WRITE_THREADS) -> None:
        super().__init__(str(path), save_distributed=True)
        self.threads = _default_threads(threads)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        from torch.distributed.checkpoint._hf_utils import (
            CUSTOM_METADATA_KEY,
            DCP_VERSION_KEY,
            FORMAT_KEY,
            FORMAT_VALUE,
            HF_DCP_VERSION,
            _gen_file_name,
        )

        storage_data = plan.storage_data or {}
        if (not plan.items or "fqn_to_index_mapping" in storage_data or self.enable_consolidation
                or any(wi.type == WriteItemType.BYTE_IO for wi in plan.items)):
            return super().write_data(plan, planner)
        tensors = [(wi, planner.resolve_data(wi).detach()) for wi in plan.items]
        if any(t.dtype not in _ST_DTYPES or t.layout != torch.strided for _, t in tensors):
            return super().write_data(plan, planner)
        file_name = _gen_file_name(1, 1, storage_data.get("shard_index"))
        tensors.sort(key=lambda e: (-e[1].element_size(), e[0].index.fqn))
        header: dict[str, Any] = {"__metadata__": {
            CUSTOM_METADATA_KEY: json.dumps({wi.index.fqn: {"saved_offsets": list(wi.tensor_data.chunk.offsets)}
                                             for wi, _ in tensors}),
            DCP_VERSION_KEY: str(HF_DCP_VERSION),
            FORMAT_KEY: FORMAT_VALUE,
        }}
        offset = 0
        for wi, t in tensors:
            n = t.numel() * t.element_size()
            header[wi.index.fqn] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
            offset += n
        head = json.dumps(header, separators=(",", ":")).encode("utf-8")
        head += b" " * (-len(head) % 8)
        pieces: list[Any] = [struct.pack("<Q", len(head)) + head]
        results = []
        for wi, t in tensors:
            begin = header[wi.index.fqn]["data_offsets"][0]
            pieces.append(_Lazy(t))
            results.append(WriteResult(index=wi.index, size_in_bytes=_length(pieces[-1]),
                                       storage_data=_StorageInfo(file_name, 8 + len(head) + begin, _length(pieces[-1]))))
        write_file(Path(self.fs.concat_path(self.path, file_name)), pieces, self.threads)
        return _done(results)


# --- reading -----------------------------------------------------------------------------------------


def _contiguous_range(shape: tuple[int, ...], offsets: tuple[int, ...], lengths: tuple[int, ...]) -> tuple[int, int] | None:
    """``(first element, element count)`` when the piece ``offsets``/``lengths`` of a C-contiguous tensor of
    ``shape`` is one contiguous run of elements, else None."""
    j = len(shape) - 1
    while j >= 0 and offsets[j] == 0 and lengths[j] == shape[j]:
        j -= 1
    if any(lengths[i] != 1 for i in range(j)):
        return None
    stride, strides = 1, [0] * len(shape)
    for i in range(len(shape) - 1, -1, -1):
        strides[i] = stride
        stride *= shape[i]
    count = 1
    for n in lengths:
        count *= n
    return sum(o * s for o, s in zip(offsets, strides)), count


@dataclasses.dataclass
class _Located:
    """A saved tensor in a file: C-contiguous ``shape`` of ``dtype`` starting at byte ``offset``."""

    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def _pread_into(fd: int, view: memoryview, offset: int) -> None:
    while view.nbytes:
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise OSError(f"unexpected end of file at byte {offset}")
        view = view[n:]
        offset += n


class _ReadJob:
    """Read one request: the saved piece's bytes straight into the destination, or via a buffer and ``copy_``."""

    def __init__(self, fd: int, located: _Located, offsets: tuple[int, ...], lengths: tuple[int, ...],
                 target: torch.Tensor) -> None:
        self.fd, self.located, self.offsets, self.lengths, self.target = fd, located, offsets, lengths, target
        itemsize = torch.empty((), dtype=located.dtype).element_size()
        span = _contiguous_range(located.shape, offsets, lengths)
        self.direct = (span is not None and target.device.type == "cpu" and target.is_contiguous()
                       and target.dtype == located.dtype and tuple(target.shape) == tuple(lengths))
        if span is not None:
            self.start = located.offset + span[0] * itemsize
            self.nbytes = span[1] * itemsize
        else:  # whole rows of dimension 0 that contain the piece
            row = itemsize
            for n in located.shape[1:]:
                row *= n
            self.start = located.offset + offsets[0] * row
            self.nbytes = lengths[0] * row if located.shape else itemsize
        self.span = span

    def pieces(self) -> list[tuple[int, int]]:
        """Direct reads split into ``CHUNK`` pieces: (start within the target, length)."""
        return [(s, min(CHUNK, self.nbytes - s)) for s in range(0, self.nbytes, CHUNK)] or [(0, 0)]

    def read_direct(self, start: int, length: int) -> None:
        if length:
            _pread_into(self.fd, _tensor_memory(self.target, writable=True)[start:start + length], self.start + start)

    def read_copy(self) -> None:
        itemsize = torch.empty((), dtype=self.located.dtype).element_size()
        buffer = torch.empty(self.nbytes // itemsize, dtype=self.located.dtype)
        _pread_into(self.fd, _tensor_memory(buffer, writable=True), self.start)
        if self.span is not None:
            piece = buffer.view(tuple(self.lengths))
        else:
            rows = buffer.view((self.lengths[0], *self.located.shape[1:]))
            piece = rows
            for dim in range(1, len(self.lengths)):
                piece = piece.narrow(dim, self.offsets[dim], self.lengths[dim])
        if tuple(self.target.shape) != tuple(piece.shape):
            raise AssertionError(f"size mismatch: {tuple(self.target.shape)} vs {tuple(piece.shape)}")
        self.target.copy_(piece)


def _run_reads(jobs: list[_ReadJob], threads: int) -> None:
    tasks: list[Callable[[], None]] = []
    for job in jobs:
        if job.direct:
            tasks += [lambda job=job, s=s, n=n: job.read_direct(s, n) for s, n in job.pieces()]
        else:
            tasks.append(job.read_copy)
    if threads > 1 and len(tasks) > 1:
        with ThreadPoolExecutor(min(threads, len(tasks)), thread_name_prefix="ckpt-read") as pool:
            for f in [pool.submit(t) for t in tasks]:
                f.result()
    else:
        for t in tasks:
            t()


class _Files:
    """Open file descriptors by path, closed together."""

    def __init__(self) -> None:
        self.fds: dict[str, int] = {}

    def get(self, path: str) -> int:
        fd = self.fds.get(path)
        if fd is None:
            fd = self.fds[path] = os.open(path, os.O_RDONLY)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        return fd

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def _finish_reads(reqs_targets: list[tuple[Any, torch.Tensor]], planner: LoadPlanner) -> Future:
    for req, target in reqs_targets:
        planner.commit_tensor(req, target)
    fut: Future = Future()
    fut.set_result(None)
    return fut


# safetensors --------------------------------------------------------------------------------------


def safetensors_header(fd: int) -> tuple[int, dict[str, Any]]:
    """``(data start, header)`` of an open safetensors file."""
    head = os.pread(fd, 8, 0)
    if len(head) != 8:
        raise OSError("not a safetensors file (shorter than 8 bytes)")
    (n,) = struct.unpack("<Q", head)
    raw = os.pread(fd, n, 8)
    if len(raw) != n:
        raise OSError("not a safetensors file (truncated header)")
    return 8 + n, json.loads(raw)


def read_safetensors(reader: Any, plan: LoadPlan, planner: LoadPlanner, threads: int) -> Future | None:
    """``HuggingFaceStorageReader.read_data`` with ``preadv`` into the destinations; None: use torch's instead."""
    files = _Files()
    try:
        headers: dict[str, tuple[int, dict[str, Any]]] = {}
        jobs, done = [], []
        for req in plan.items:
            info = reader.storage_data[req.storage_index]
            path = str(info.relative_path)
            fd = files.get(path)
            if path not in headers:
                headers[path] = safetensors_header(fd)
            start, header = headers[path]
            entry = header.get(req.storage_index.fqn)
            if entry is None or entry.get("dtype") not in _ST_CODES:
                return None
            located = _Located(start + entry["data_offsets"][0], tuple(entry["shape"]), _ST_CODES[entry["dtype"]])
            target = planner.resolve_tensor(req).detach()
            jobs.append(_ReadJob(fd, located, tuple(req.storage_offsets), tuple(req.lengths), target))
            done.append((req, target))
        _run_reads(jobs, threads)
        return _finish_reads(done, planner)
    finally:
        files.close()


# torch.save records ---------------------------------------------------------------------------------

class _FileView(io.RawIOBase):
    """A read-only, seekable view of ``length`` bytes at ``offset`` of an open file (positioned reads)."""

    def __init__(self, fd: int, offset: int, length: int) -> None:
        super().__init__()
        self.fd, self.offset, self.length, self.pos = fd, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos if whence == 0 else self.pos + pos if whence == 1 else self.length + pos
        return self.pos

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), self.length - self.pos))
        data = os.pread(self.fd, n, self.offset + self.pos) if n else b""
        buffer[: len(data)] = data
        self.pos += len(data)
        return len(data)


_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_LOCAL_MAGIC = 0x04034B50


def _zip_entries(fd: int, offset: int, length: int) -> dict[str, tuple[int, int]] | None:
    """``{name without the archive folder: (absolute data offset, size)}`` of a torch.save zip archive stored
    uncompressed at ``offset``; None if it is not one."""
    import zipfile

    try:
        with zipfile.ZipFile(_FileView(fd, offset, length)) as archive:
            infos = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        return None
    entries: dict[str, tuple[int, int]] = {}
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED or info.header_offset + 30 > length:
            return None
        head = os.pread(fd, 30, offset + info.header_offset)
        magic, *_rest, nlen, xlen = _LOCAL_HEADER.unpack(head) if len(head) == 30 else (0, 0, 0)
        if magic != _LOCAL_MAGIC:
            return None
        data_at = info.header_offset + 30 + nlen + xlen
        if data_at + info.file_size > length:
            return None
        short = info.filename.split("/", 1)[1] if "/" in info.filename else info.filename
        entries[short] = (offset + data_at, info.file_size)
    return entries


@functools.lru_cache(maxsize=1)
def _storage_dtypes() -> dict[str, torch.dtype]:
    """``{"FloatStorage": torch.float32, ...}``: the storage names torch.save pickles for each dtype."""
    try:
        return torch.storage._storage_type_to_dtype_map()
    except AttributeError:
        return {}


class _StorageRef:
    def __init__(self, key: str, dtype: torch.dtype, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


class _TensorMeta(pickle.Unpickler):
    """Reads a torch.save'd tensor's pickle into (storage, storage offset, size, stride) without building it.

    Only the globals a plain tensor's pickle holds are resolved; anything else means "use torch.load".
    """

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *rest: (storage, offset, tuple(size), tuple(stride))
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if module == "torch" and name.endswith("Storage"):
            dtype = _storage_dtypes().get(name)
            if dtype is not None:
                return dtype
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError("unexpected persistent id")
        _, dtype, key, _location, numel = pid
        if not isinstance(dtype, torch.dtype):
            raise pickle.UnpicklingError("unexpected storage type")
        return _StorageRef(str(key), dtype, int(numel))


def _locate_record(fd: int, offset: int, length: int) -> _Located | None:
    """Where the tensor of a torch.save record (``FileSystemWriter``'s format) keeps its data, if recognised."""
    entries = _zip_entries(fd, offset, length)
    if not entries or "data.pkl" not in entries:
        return None
    pkl_at, pkl_len = entries["data.pkl"]
    try:
        meta = _TensorMeta(io.BytesIO(os.pread(fd, pkl_len, pkl_at))).load()
    except Exception:  # noqa: BLE001 - not a plain tensor: torch.load decides
        return None
    if not (isinstance(meta, tuple) and len(meta) == 4 and isinstance(meta[0], _StorageRef)):
        return None
    storage_ref, storage_offset, size, stride = meta
    data = entries.get(f"data/{storage_ref.key}")
    if data is None:
        return None
    expected, s = [], 1
    for n in reversed(size):
        expected.append(s)
        s *= n
    if tuple(reversed(expected)) != tuple(stride) and s > 1:
        return None  # not C-contiguous
    itemsize = torch.empty((), dtype=storage_ref.dtype).element_size()
    if (storage_offset + s) * itemsize > data[1]:
        return None
    return _Located(data[0] + storage_offset * itemsize, tuple(size), storage_ref.dtype)


def read_distcp(reader: Any, plan: LoadPlan, planner: LoadPlanner, threads: int) -> Future | None:
    """``FileSystemReader.read_data`` with ``preadv`` into the destinations; None: use torch's instead.

    Byte entries (optimizer ``param_groups`` values ...) go to ``planner.load_bytes`` as before.
    """
    files = _Files()
    try:
        jobs, done, byte_reads = [], [], []
        for req in plan.items:
            info: _StorageInfo = reader.storage_data[req.storage_index]
            if info.transform_descriptors:
                return None
            fd = files.get(str(Path(reader.path) / info.relative_path))
            if req.type == LoadItemType.BYTE_IO:
                byte_reads.append((req, fd, info))
                continue
            located = _locate_record(fd, info.offset, info.length)
            if located is None:
                return None
            target = planner.resolve_tensor(req).detach()
            jobs.append(_ReadJob(fd, located, tuple(req.storage_offsets), tuple(req.lengths), target))
            done.append((req, target))
        for req, fd, info in byte_reads:
            data = os.pread(fd, info.length, info.offset)
            if len(data) != info.length:
                raise OSError(f"unexpected end of file in '{info.relative_path}'")
            planner.load_bytes(req, io.BytesIO(data))
        _run_reads(jobs, threads)
        return _finish_reads(done, planner)
    finally:
        files.close()


# --- optimizer state ---------------------------------------------------------------------------------


class _UninitialisedZeros(torch.overrides.TorchFunctionMode):
    """``zeros_like`` allocates without filling: the state it creates is about to be overwritten by the load."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.zeros_like:
            return torch.empty_like(*args, **kwargs)
        return func(*args, **kwargs)


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> bool:
    """Create the optimizer's state without an optimizer step, so there is state to load into.

    torch's ``get_optimizer_state_dict`` otherwise runs ``step()`` on zero gradients, which costs several passes
    over the whole state. Uses the optimizer's own lazy initialisation (``_init_group``, as torch's optimizers
    have), with the moments allocated but not zero-filled: the caller loads every value (``load_optimizer``
    clears the state again if that fails). Returns False, changing nothing, where ``_init_group`` is not
    available or does not create every parameter's state (torch's way then applies).
    """
    if optimizer.state:
        return True
    init_group = getattr(optimizer, "_init_group", None)
    if init_group is None:
        return False
    try:
        params = inspect.signature(init_group).parameters
    except (TypeError, ValueError):
        return False
    names = list(params)
    if not names or names[0] != "group" or any(p.default is not inspect.Parameter.empty
                                                or p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                                                for p in params.values()):
        return False
    wanted = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    saved = {p: p.grad for p in wanted}
    try:
        with torch.no_grad(), _UninitialisedZeros():
            for p in wanted:
                p.grad = torch.empty_like(p)  # never read: only its presence and shape matter
            for group in optimizer.param_groups:
                init_group(group, *[[] for _ in names[1:]])
    except Exception:  # noqa: BLE001 - any surprise: undo and let torch initialise by a step
        optimizer.state.clear()
        return False
    finally:
        for p, g in saved.items():
            p.grad = g
    if not all(optimizer.state.get(p) for p in wanted):
        optimizer.state.clear()
        return False
    return True


# --- readers -----------------------------------------------------------------------------------------

from automodel_ckpt.checkpoint.safe_load import CachingHFReader, SafeFileSystemReader  # noqa: E402


class ParallelHFReader(CachingHFReader):
    """``CachingHFReader`` whose reads go straight into the destination tensors (``read_safetensors``)."""

    def __init__(self, path: str | os.PathLike, *, threads: int = READ_THREADS) -> None:
        super().__init__(str(path))
        self.threads = _default_threads(threads)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        return read_safetensors(self, plan, planner, self.threads) or super().read_data(plan, planner)


class ParallelFileSystemReader(SafeFileSystemReader):
    """``SafeFileSystemReader`` whose reads go straight into the destination tensors (``read_distcp``)."""

    def __init__(self, path: str | os.PathLike, *, threads: int = READ_THREADS) -> None:
        super().__init__(str(path))
        self.threads = _default_threads(threads)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        return read_distcp(self, plan, planner, self.threads) or super().read_data(plan, planner)
