"""The torch.save record format of DCP ``.distcp`` files: what surrounds a tensor's bytes, and where they are."""

from __future__ import annotations

import io
import math
import os
import pickle
import struct
import threading
import zipfile
import zlib
from typing import Any

import torch

from automodel_ckpt.ondisk.fastio.common import Located, itemsize
from automodel_ckpt.ondisk.fastio.filewrite import Lazy
from automodel_ckpt.ondisk.formats.safe_load import StorageRef, TensorRecordUnpickler

# --- writing: what torch.save puts around a tensor's bytes -------------------------------------------

_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_LOCAL_MAGIC = 0x04034B50
_CENTRAL_HEADER = struct.Struct("<IHHHHHHIIIHHHHHII")
_CENTRAL_MAGIC = 0x02014B50
_END = struct.Struct("<IHHHHIIH")
_END_MAGIC = 0x06054B50


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
    """What surrounds a tensor's bytes in its record, ``None`` where they go (``compact_template``, else
    ``torch_template``); None when neither can be made. Cached per shape and dtype."""
    key = (tuple(shape), dtype)
    with _TEMPLATES_LOCK:
        if key in _TEMPLATES:
            return _TEMPLATES[key]
    template = compact_template(shape, dtype) or torch_template(shape, dtype)
    if template is not None:
        with _TEMPLATES_LOCK:
            _TEMPLATES[key] = template
    return template


def torch_template(shape: torch.Size, dtype: torch.dtype) -> list[bytes | None] | None:
    """What ``torch.save`` writes around a tensor of ``shape`` and ``dtype`` (zip64: any size), or None."""
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
    return template


class _Entries:
    """Stands in for torch's zip writer: keeps each entry's name and bytes (the tensor's storage as ``None``)."""

    def __init__(self) -> None:
        self.entries: list[tuple[str, bytes | None, int]] = []

    def write_record(self, name: str, data: Any, nbytes: int) -> None:
        if isinstance(data, str):
            data = data.encode()
        self.entries.append((name, bytes(data) if isinstance(data, (bytes, bytearray)) else None, int(nbytes)))


_ARCHIVE = "archive/"
_DOS_DATE = (1 << 5) | 1  # 1980-01-01, the earliest date a zip entry holds
_COMPACT_MAX = (1 << 32) - (1 << 20)  # zip32 sizes and offsets: larger records take torch's template (zip64)
_VERSION: list[bytes] = []


def _file_format_version() -> bytes:
    """The ``version`` entry torch writes (the archive format version its readers check), read once."""
    if not _VERSION:
        buffer = io.BytesIO()
        torch.save(torch.zeros(()), buffer)
        with zipfile.ZipFile(buffer) as archive:
            name = next(n for n in archive.namelist() if n.split("/", 1)[-1] == "version")
            _VERSION.append(archive.read(name))
    return _VERSION[0]


def compact_template(shape: torch.Size, dtype: torch.dtype) -> list[bytes | None] | None:
    """A torch.save record holding only what ``torch.load`` reads (``data.pkl``, ``byteorder``, ``data/0``,
    ``version``; stored, unpadded, zip32): about 0.6 KiB to torch's 1.5 (the rest serves ``mmap`` loads and
    tracing). ``None`` where the data goes; None where zip64 is needed or torch's internals moved."""
    stand_in = torch.empty(shape, dtype=dtype)  # pages never touched: costs no memory
    nbytes = stand_in.numel() * stand_in.element_size()
    if nbytes >= _COMPACT_MAX:
        return None
    entries = _Entries()
    try:
        torch.serialization._save(stand_in, entries, pickle, torch.serialization.DEFAULT_PROTOCOL, False)
        version = _file_format_version()
    except Exception:  # noqa: BLE001 - torch's internals moved: torch's template
        return None
    kept = {name: (data, n) for name, data, n in entries.entries}
    if set(kept) != {"data.pkl", ".format_version", ".storage_alignment", "byteorder", "data/0"} \
            or kept["data/0"] != (None, nbytes) or kept["data.pkl"][0] is None or kept["byteorder"][0] is None:
        return None
    order = [("data.pkl", kept["data.pkl"][0]), ("byteorder", kept["byteorder"][0]), ("data/0", None),
             ("version", version)]
    template: list[bytes | None] = []
    head, central, at = bytearray(), bytearray(), 0
    for name, data in order:
        encoded = (_ARCHIVE + name).encode()
        size = nbytes if data is None else len(data)
        crc = 0 if data is None else zlib.crc32(data)  # the tensor's bytes unsummed, as torch's own writer leaves them
        local = _LOCAL_HEADER.pack(_LOCAL_MAGIC, 20, 0, 0, 0, _DOS_DATE, crc, size, size, len(encoded), 0)
        central += _CENTRAL_HEADER.pack(_CENTRAL_MAGIC, 20, 20, 0, 0, 0, _DOS_DATE, crc, size, size, len(encoded),
                                        0, 0, 0, 0, 0, at) + encoded
        head += local + encoded
        at += len(local) + len(encoded) + size
        if data is None:
            template += [bytes(head), None]
            head = bytearray()
        else:
            head += data
    count = len(order)
    head += central + _END.pack(_END_MAGIC, 0, 0, count, count, len(central), at, 0)
    template.append(bytes(head))
    return template


def torch_save_pieces(tensor: torch.Tensor) -> list[Any] | None:
    if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_sparse or type(tensor) is not torch.Tensor:
        return None
    template = _record_template(tensor.shape, tensor.dtype)
    if template is None:
        return None
    return [Lazy(tensor) if part is None else part for part in template]


#: The ``_StorageInfo`` attribute where the writer notes ``(offset in the record, shape, dtype)`` of a tensor.
NOTE = "tensor_bytes"


def note_location(info: Any, pieces: list[Any]) -> Any:
    """``info`` with ``NOTE`` set when ``pieces`` (from ``torch_save_pieces``) hold a non-empty tensor's bytes."""
    at = 0
    for piece in pieces:
        if isinstance(piece, Lazy):
            t = piece.tensor
            if t.numel():
                setattr(info, NOTE, (at, tuple(int(n) for n in t.shape), t.dtype))
            return info
        at += len(piece)
    return info


def noted_location(info: Any, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> Located | None:
    """Where ``info``'s record keeps its tensor as its writer noted it, if well formed and holding the piece."""
    note = getattr(info, NOTE, None)
    if not (isinstance(note, tuple) and len(note) == 3):
        return None
    at, shape, dtype = note
    if not (isinstance(at, int) and isinstance(dtype, torch.dtype) and isinstance(shape, tuple)
            and all(isinstance(n, int) and n >= 0 for n in shape) and len(shape) == len(offsets) == len(lengths)):
        return None
    if any(o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, lengths, shape)):
        return None
    try:
        nbytes = math.prod(shape) * itemsize(dtype)
    except (KeyError, TypeError, RuntimeError):
        return None
    if at < 0 or at + nbytes > info.length:
        return None
    return Located(info.offset + at, shape, dtype)


def torch_save_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


# --- reading: locating a tensor's bytes in a record ---------------------------------------------------------

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


def _zip_entries(fd: int, offset: int, length: int) -> dict[str, tuple[int, int]] | None:
    """``{name: (absolute data offset, size)}`` of an uncompressed torch.save archive at ``offset``, or None."""
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


def locate_record(fd: int, offset: int, length: int) -> Located | None:
    """Where the tensor of a torch.save record (``FileSystemWriter``'s format) keeps its data, if recognised."""
    entries = _zip_entries(fd, offset, length)
    if not entries or "data.pkl" not in entries:
        return None
    pkl_at, pkl_len = entries["data.pkl"]
    try:
        meta = TensorRecordUnpickler(io.BytesIO(os.pread(fd, pkl_len, pkl_at))).load()
    except Exception:  # noqa: BLE001 - not a plain tensor: torch.load decides
        return None
    if not (isinstance(meta, tuple) and len(meta) == 4 and isinstance(meta[0], StorageRef)):
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
    size_of = itemsize(storage_ref.dtype)
    if (storage_offset + s) * size_of > data[1]:
        return None
    return Located(data[0] + storage_offset * size_of, tuple(size), storage_ref.dtype)

