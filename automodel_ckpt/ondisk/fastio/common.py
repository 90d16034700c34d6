"""Shared by the parallel file writers and readers: chunk size, thread counts, raw tensor memory, dtype codes."""

from __future__ import annotations

import ctypes
import dataclasses
import math
import mmap
import os
import sys
import threading

import torch

CHUNK = 32 << 20  # bytes per positioned write or read, and per writeback request
WRITE_THREADS = 4  # per rank
READ_THREADS = 4  # per rank
SMALL = 1 << 20  # pieces below this are coalesced into one buffer before writing


class _ReadCounter:
    """Bytes this process has read from tensor files (``preadv`` calls of the readers): what a load cost."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.total = 0

    def add(self, n: int) -> None:
        with self._lock:
            self.total += n


BYTES_READ = _ReadCounter()


def default_threads(wanted: int) -> int:
    return max(1, min(wanted, 2 * (os.cpu_count() or 1)))


_MEMORY_FILESYSTEMS = (0x01021994, 0x858458F6)  # statfs f_type of tmpfs and ramfs


def memory_backed(path: str | os.PathLike) -> bool:
    """Whether ``path`` lies on a filesystem in memory (tmpfs, ramfs), where O_DIRECT only costs a copy."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        buf = ctypes.create_string_buffer(256)  # struct statfs: f_type (a C long) comes first
        if libc.statfs(os.fsencode(path), buf) != 0:
            return False
    except (OSError, AttributeError):
        return False
    return ctypes.c_long.from_buffer(buf).value in _MEMORY_FILESYSTEMS


def tensor_memory(t: torch.Tensor, writable: bool = False) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (the caller keeps ``t`` alive while using them)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    view = memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")
    return view if writable else view.toreadonly()


def scratch(shape: int | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``shape`` on a mapping of its own, returned once dropped (not resident on glibc's heap)."""
    nbytes = math.prod((shape,) if isinstance(shape, int) else shape) * itemsize(dtype)
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(dtype).view(shape)


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclasses.dataclass
class Located:
    """A saved tensor in a file: C-contiguous ``shape`` of ``dtype`` starting at byte ``offset``."""

    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype


ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("uint16", "U16"),
                     ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):
        ST_DTYPES[getattr(torch, _name)] = _code
ST_CODES = {code: dtype for dtype, code in ST_DTYPES.items()}


def compact(tensor: torch.Tensor) -> torch.Tensor:
    """What torch's writer saves: the tensor on the CPU, with a storage of its own size."""
    t = tensor.cpu()
    return t.clone() if t.untyped_storage().size() != t.numel() * t.element_size() else t
