"""Low-level safetensors format pieces: dtype names, header reading and writing, positioned file I/O."""

from __future__ import annotations

import json
import math
import os
import struct
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from automodel_ckpt.ondisk import bounded
from automodel_ckpt.ondisk.paths import open_regular
from automodel_ckpt.errors import CheckpointError, first_line

if TYPE_CHECKING:
    import torch

_HEADER_LEN_BYTES = 8
_METADATA_KEY = "__metadata__"
# safetensors' own limit on a header; a bigger length means the file is not safetensors.
_MAX_HEADER_BYTES = bounded.SAFETENSORS_HEADER

# safetensors dtype names in its ``Dtype`` enum's order, by which (largest first, then by name) it lays tensors out:
# every tensor aligned, our files byte-identical to ``safetensors.torch.save_file``'s.
_DTYPE_ORDER = (
    "BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ",
    "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64",
)  # fmt: skip
_DTYPE_RANK = {name: i for i, name in enumerate(_DTYPE_ORDER)}
# Bits per element of every safetensors dtype (F4 and F6 pack several elements into a byte).
_DTYPE_BITS: dict[str, int] = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32,
    "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}  # fmt: skip

_TORCH_NAMES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "I32": "int32", "U32": "uint32",
    "I64": "int64", "U64": "uint64", "F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64",
    "C64": "complex64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz", "F8_E8M0": "float8_e8m0fnu",
}  # fmt: skip


@cache
def _torch_dtypes() -> dict[str, torch.dtype]:
    """safetensors name -> torch dtype this torch knows; built on first use (headers alone need no torch)."""
    import torch

    return {st: getattr(torch, name) for st, name in _TORCH_NAMES.items()
            if isinstance(getattr(torch, name, None), torch.dtype)}


@cache
def _st_names() -> dict[torch.dtype, str]:
    return {dt: st for st, dt in _torch_dtypes().items()}


def __getattr__(name: str) -> Any:
    if name == "ST_TO_TORCH":  # the table as a module attribute, built on first use
        return _torch_dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def st_dtype_name(dtype: torch.dtype) -> str:
    """safetensors name of a torch dtype (``torch.bfloat16`` -> ``"BF16"``)."""
    try:
        return _st_names()[dtype]
    except KeyError:
        raise CheckpointError(f"dtype {dtype} cannot be stored in safetensors") from None


def _is_fp8(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype.itemsize == 1


def is_plain_float(dtype: torch.dtype) -> bool:
    """A floating dtype that may be cast freely: 16, 32 or 64 bit floats (not fp8, not complex)."""
    return dtype.is_floating_point and not _is_fp8(dtype)


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """``(header, data_start)`` of a safetensors file, reading only its first bytes; ``CheckpointError`` naming the
    file when the header is missing, short, too large, not JSON or malformed, or the path no regular file."""
    path = Path(path)
    try:
        with os.fdopen(open_regular(path, follow=True), "rb") as f:
            return header_at(f.fileno(), path)
    except FileNotFoundError:
        raise CheckpointError(f"missing safetensors file {path}") from None
    except IsADirectoryError:
        raise CheckpointError(f"expected a safetensors file, found a folder: {path}") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read safetensors file {path}: {exc}") from None


def header_at(fd: int, path: Path | str) -> tuple[dict[str, Any], int]:
    """``read_header`` of the open safetensors file ``fd`` (``path`` names it in errors); ``OSError`` propagates."""
    size = os.fstat(fd).st_size
    header_len = header_length(os.pread(fd, _HEADER_LEN_BYTES, 0), size, path)
    raw = os.pread(fd, header_len, _HEADER_LEN_BYTES)
    if len(raw) < header_len:
        raise CheckpointError(f"truncated safetensors file {path}: header cut short")
    header = parse_header(raw, path)
    check_header(header, size - _HEADER_LEN_BYTES - header_len, path)
    return header, _HEADER_LEN_BYTES + header_len


def header_length(raw_len: bytes, file_size: int, path: Path | str) -> int:
    """The header length a file's first 8 bytes give, checked against safetensors' limit and the file's size."""
    if len(raw_len) < _HEADER_LEN_BYTES:
        raise CheckpointError(f"truncated safetensors file {path}: {len(raw_len)} bytes, no header")
    (header_len,) = struct.unpack("<Q", raw_len)
    if header_len > _MAX_HEADER_BYTES:
        raise CheckpointError(f"damaged safetensors file {path}: header length {header_len} is over safetensors' "
                              f"limit of {_MAX_HEADER_BYTES} bytes")
    if _HEADER_LEN_BYTES + header_len > file_size:
        raise CheckpointError(f"truncated safetensors file {path}: header length {header_len} is more than the "
                              f"file's {file_size} bytes")
    return header_len


def parse_header(raw: bytes, path: Path | str) -> dict[str, Any]:
    """The JSON object of a header (size and nesting bounded), else a one-line ``CheckpointError``."""
    try:
        header = bounded.parse_json(raw, f"safetensors file {path}", "a safetensors header", _MAX_HEADER_BYTES)
    except CheckpointError as exc:
        raise CheckpointError(f"damaged {first_line(exc)}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"damaged safetensors file {path}: header is not a JSON object")
    return header


def check_header(header: dict[str, Any], data_len: int, path: Path | str) -> None:
    """Every entry has a known dtype, a shape whose bytes are its byte range, and a range inside the data area
    (``data_len`` bytes), none overlapping; else a one-line ``CheckpointError`` naming the file and the tensor."""
    meta = header.get(_METADATA_KEY)
    if meta is not None and not isinstance(meta, dict):
        raise CheckpointError(f"damaged safetensors file {path}: {_METADATA_KEY} is not a JSON object")
    ranges = sorted((*_entry_range(name, entry, path), name) for name, entry in tensor_entries(header).items())
    needed = max((end for _, end, _ in ranges), default=0)
    if needed > data_len:
        raise CheckpointError(f"truncated shard file {path}: its data area holds {data_len} bytes, its header "
                              f"needs {needed}")
    for (_, end, first), (begin, _, second) in zip(ranges, ranges[1:]):
        if begin < end:
            raise CheckpointError(f"damaged safetensors file {path}: the bytes of tensors '{first}' and '{second}' "
                                  "overlap")


def _entry_range(name: str, entry: Any, path: Path | str) -> tuple[int, int]:
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"damaged safetensors file {path}: tensor '{name}' {why}")

    if not isinstance(entry, dict):
        raise bad("is not a JSON object")
    dtype = entry.get("dtype")
    bits = _DTYPE_BITS.get(dtype) if isinstance(dtype, str) else None
    if bits is None:
        raise bad(f"has the unknown dtype {str(entry.get('dtype'))[:40]!r}")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or len(shape) > bounded.MAX_SHAPE_DIMS or \
            not all(bounded.is_count(d) for d in shape):
        raise bad(f"has a shape that is not a list of at most {bounded.MAX_SHAPE_DIMS} non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(bounded.is_count(o) for o in offsets):
        raise bad("has data_offsets that are not two non-negative integers")
    begin, end = offsets
    if begin > end:
        raise bad(f"has the byte range [{begin}, {end}), which ends before it begins")
    if math.prod(shape) * bits != (end - begin) * 8:
        raise bad(f"has {end - begin} bytes, not the {math.prod(shape) * bits // 8} its shape {shape} needs")
    return begin, end


def tensor_entries(header: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The tensor entries of a header (everything but ``__metadata__``)."""
    return {k: v for k, v in header.items() if k != _METADATA_KEY}


def layout_order(items: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """``(name, st_dtype)`` pairs in the order safetensors lays tensors out: largest dtype first, then by name."""
    return sorted(items, key=lambda item: (-_DTYPE_RANK.get(item[1], -1), item[0]))


def encode_header(entries: list[tuple[str, str, tuple[int, ...], int]], metadata: dict[str, str] | None) -> bytes:
    """Length prefix + JSON header for ``(name, st_dtype, shape, nbytes)`` entries laid out back to back, padded
    with spaces to a multiple of 8 bytes as safetensors does (every tensor aligned, given ``layout_order``)."""
    header: dict[str, Any] = {}
    if metadata:
        header[_METADATA_KEY] = metadata
    offset = 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def pread_full(fd: int, view: memoryview, offset: int) -> int:
    """Read ``fd`` from ``offset`` into the bytes of ``view`` until it is full or the file ends; the bytes read."""
    done = 0
    while done < view.nbytes:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


def pread_into(fd: int, buf: memoryview, offset: int, path: Path) -> None:
    """Fill ``buf`` from ``fd`` at ``offset``; a short file is a truncated checkpoint."""
    if pread_full(fd, buf, offset) < buf.nbytes:
        raise CheckpointError(f"truncated file {path}: ends before byte {offset + buf.nbytes}")


def pwrite_all(fd: int, data: memoryview | bytes, offset: int) -> None:
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)
