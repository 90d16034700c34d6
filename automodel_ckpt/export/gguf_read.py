"""Reading a GGUF file that may be hostile: its header and metadata for `inspect` and `pack`, every tensor for `verify`.

The header is walked once, streamed: every count and length is checked against the bytes left in the file and a cap
(``MAX_KEYS``, ``MAX_TENSORS``, ``MAX_ARRAY``, ``MAX_ARRAY_ITEMS``) before it is used. Arrays are skipped, never held
(only their item type and count), and strings over ``_SHOWN_STRING`` bytes are never read, so memory is bounded by
the number of keys and tensors, never by what the file claims; what does not fit is one ``CheckpointError`` line.
``tensor_layout`` checks every tensor's bytes lie inside the file without overlap (so `pack` and `diff` read at most
the file's bytes); ``verify_gguf`` also decodes every tensor to finite values.
"""

from __future__ import annotations

import math
import os
import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from automodel_ckpt.ondisk import open_regular
from automodel_ckpt.errors import CheckpointError, first_line

GGUF_MAGIC = b"GGUF"
GGUF_SUFFIX = ".gguf"  # how a GGUF file's name ends
_VERSIONS = (2, 3)
_MIN_KV_BYTES = 8 + 1 + 4 + 1  # key length, a one-byte key, the value type, a one-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 8 + 4 + 8  # name length, name, dims, one dim, type, offset
MAX_KEYS = 1 << 16  # real models have about 50
MAX_TENSORS = 1 << 16  # real models have under 10^4 (a mixture of experts stacks its experts)
MAX_ARRAY = 1 << 22  # items of one array: vocabularies and merge lists are under 10^6
MAX_ARRAY_ITEMS = 1 << 23  # items of all arrays of a file together
_MAX_NAME = 1 << 16  # bytes of a key or a tensor name
_MAX_DIMS = 8  # ggml has 4
_MAX_DEPTH = 4  # arrays of arrays
_SHOWN_STRING = 4096  # a string value longer than this is skipped, never read
_SHOWN_KEYS = ("general.architecture", "general.name", "general.file_type", "tokenizer.ggml.model",
               "tokenizer.ggml.pre")
# GGUF value types: fixed sizes (struct formats), strings (8), arrays (9)
_FIXED = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def is_gguf(path: Path) -> bool:
    """Whether ``path`` is a file named ``*.gguf`` or starting with the GGUF magic (a ``.gguf`` file without it is
    then refused by ``open_gguf`` for what it is, rather than read as something else)."""
    try:
        if not Path(path).is_file():
            return False
        if Path(path).name.endswith(GGUF_SUFFIX):
            return True
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


@dataclass
class GGUFArray:
    """An array value, never read: its item type (a GGUF value type number) and count."""

    item_type: int
    count: int


@dataclass
class GGUFTensor:
    """One entry of the tensor table: ``dims`` innermost first (as stored), ``offset`` from the start of the file."""

    name: str
    dims: tuple[int, ...]
    tensor_type: Any  # gguf.GGMLQuantizationType
    offset: int

    @property
    def n_elements(self) -> int:
        return math.prod(self.dims)


@dataclass
class GGUFHeader:
    """What the header of a GGUF file holds, bounded: metadata values (scalars, short strings, arrays as
    ``GGUFArray``; a long string as ``None``), the tensor table, and where the data starts."""

    path: Path
    size: int
    version: int
    values: dict[str, Any] = field(default_factory=dict)
    tensors: list[GGUFTensor] = field(default_factory=list)
    data_offset: int = 0


def open_gguf(path: Path, keep: dict[str, int] | None = None) -> GGUFHeader:
    """The header of the GGUF file ``path`` the user named (a link followed, a FIFO or device refused), bounded;
    ``keep``: keys whose string value is read up to that many bytes (a longer one is refused in one line)."""
    path = Path(path)
    try:
        fd = open_regular(path, follow=True)
    except FileNotFoundError:
        raise CheckpointError(f"the GGUF file '{path}' does not exist") from None
    except OSError as exc:
        raise CheckpointError(f"the GGUF file '{path}' cannot be read: {first_line(exc)}") from None
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(24)
        if len(head) < 24 or head[:4] != GGUF_MAGIC:
            raise CheckpointError(f"'{path}' is not a GGUF file (no GGUF magic and header in its first 24 bytes)")
        version, n_tensors, n_kv = struct.unpack("<IQQ", head[4:])
        if version not in _VERSIONS:
            raise CheckpointError(f"'{path}' is GGUF version {version}; versions "
                                  f"{', '.join(map(str, _VERSIONS))} are read")
        room = size - 24
        _count(path, n_kv, "metadata keys", room // _MIN_KV_BYTES, MAX_KEYS, size)
        _count(path, n_tensors, "tensors", room // _MIN_TENSOR_INFO_BYTES, MAX_TENSORS, size)
        walker = _Walker(f, path, size)
        walker.keep = dict(keep or {})
        return walker.header(version, n_kv, n_tensors)


def gguf_lineage_text(path: Path, limit: int, key: str = "automodel_ckpt.lineage") -> str | None:
    """The lineage record (JSON text, at most ``limit`` bytes) an export wrote into the GGUF file, or None."""
    value = open_gguf(path, keep={key: limit}).values.get(key)
    return value if isinstance(value, str) else None


def _count(path: Path, n: int, what: str, fits: int, cap: int, size: int) -> None:
    if n > fits:
        raise CheckpointError(f"'{path}' claims {n} {what}, more than its {size} bytes can hold")
    if n > cap:
        raise CheckpointError(f"'{path}' claims {n} {what}, more than the {cap} a GGUF file is read with")


class _Walker:
    """Reads a GGUF header forward from a buffered file, each length checked against the bytes left first."""

    def __init__(self, f: BinaryIO, path: Path, size: int) -> None:
        self.f, self.path, self.size, self.at, self.items = f, path, size, 24, 0
        self.keep: dict[str, int] = {}  # keys whose strings are read up to a larger bound
        self.key = ""  # the key whose value is being read

    def damaged(self, why: str) -> CheckpointError:
        return CheckpointError(f"damaged GGUF file '{self.path}': {why} at byte {self.at} (truncated, or a length "
                               "that runs past its end)")

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.at:
            raise self.damaged(f"{what} of {n} bytes runs past the end")

    def read(self, n: int, what: str) -> bytes:
        self.need(n, what)
        data = self.f.read(n)
        if len(data) != n:
            raise self.damaged(f"{what} cut short")
        self.at += n
        return data

    def skip(self, n: int, what: str) -> None:
        self.need(n, what)
        self.f.seek(n, os.SEEK_CUR)
        self.at += n

    def unpack(self, fmt: str, what: str) -> Any:
        return struct.unpack(fmt, self.read(struct.calcsize(fmt), what))[0]

    def name(self, what: str) -> str:
        n = self.unpack("<Q", f"the length of {what}")
        if n > _MAX_NAME:
            raise self.damaged(f"{what} of {n} bytes")
        return self.read(n, what).decode("utf-8", "replace")

    def value(self, kind: int, depth: int = 0) -> Any:
        """A value of GGUF type ``kind``: a scalar, a short string (a longer one skipped: ``None``), an array
        skipped over (``GGUFArray``)."""
        if kind in _FIXED:
            return self.unpack(_FIXED[kind], "a value")
        if kind == _STRING:
            n = self.unpack("<Q", "a string's length")
            if depth == 0 and self.key in self.keep:
                if n > self.keep[self.key]:
                    raise CheckpointError(f"'{self.path}': its {self.key[:80]} is {n} bytes, over the limit of "
                                          f"{self.keep[self.key]} for a lineage record")
                return self.read(n, "a string").decode("utf-8", "replace")
            if n > _SHOWN_STRING:
                self.skip(n, "a string")
                return None
            return self.read(n, "a string").decode("utf-8", "replace")
        if kind == _ARRAY:
            if depth >= _MAX_DEPTH:
                raise self.damaged(f"arrays nested more than {_MAX_DEPTH} deep")
            item, count = self.unpack("<I", "an array's item type"), self.unpack("<Q", "an array's length")
            smallest = struct.calcsize(_FIXED[item]) if item in _FIXED else 8 if item in (_STRING, _ARRAY) else None
            if smallest is None:
                raise self.damaged(f"an array of the unknown value type {item}")
            self.need(count * smallest, f"an array of {count} items")
            self.items += count
            if count > MAX_ARRAY or self.items > MAX_ARRAY_ITEMS:
                raise CheckpointError(f"'{self.path}' holds an array of {count} items ({self.items} in all), more "
                                      f"than the {MAX_ARRAY} ({MAX_ARRAY_ITEMS} in all) a GGUF file is read with")
            if item in _FIXED:
                self.skip(count * smallest, "an array")
            else:
                for _ in range(count):  # strings or arrays: each has its own length
                    if item == _STRING:
                        self.skip(self.unpack("<Q", "a string's length"), "a string")
                    else:
                        self.value(_ARRAY, depth + 1)
            return GGUFArray(item, count)
        raise self.damaged(f"the unknown value type {kind}")

    def header(self, version: int, n_kv: int, n_tensors: int) -> GGUFHeader:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        out = GGUFHeader(self.path, self.size, version)
        for _ in range(n_kv):
            key = self.key = self.name("a key")
            if key in out.values:
                raise self.damaged(f"the key '{key[:80]}' twice")
            out.values[key] = self.value(self.unpack("<I", "a value type"))
        seen: set[str] = set()
        for _ in range(n_tensors):
            name = self.name("a tensor name")
            n_dims = self.unpack("<I", "a tensor's dimension count")
            if n_dims > _MAX_DIMS:
                raise self.damaged(f"tensor '{name[:80]}' with {n_dims} dimensions")
            dims = struct.unpack(f"<{n_dims}Q", self.read(8 * n_dims, "a tensor's dimensions"))
            raw_type, offset = self.unpack("<I", "a tensor's type"), self.unpack("<Q", "a tensor's offset")
            try:
                tensor_type = GGMLQuantizationType(raw_type)
            except ValueError:
                raise self.damaged(f"tensor '{name[:80]}' of the unknown type {raw_type}") from None
            if tensor_type not in GGML_QUANT_SIZES or name in seen:
                raise self.damaged(f"tensor '{name[:80]}' " + ("twice" if name in seen else f"of type {raw_type}"))
            seen.add(name)
            out.tensors.append(GGUFTensor(name, dims, tensor_type, offset))
        alignment = out.values.get("general.alignment", 32)
        if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0 or \
                alignment & (alignment - 1):
            raise self.damaged(f"general.alignment {alignment!r}, not a power of two,")
        out.data_offset = -(-self.at // alignment) * alignment
        for t in out.tensors:
            t.offset += out.data_offset
        return out


def describe_gguf(path: Path) -> dict[str, Any]:
    """What `inspect` shows of a GGUF file: architecture, name, types of its tensors, parameters, tokenizer."""
    header = open_gguf(path)
    values = header.values
    info: dict[str, Any] = {"gguf": str(path), "bytes": header.size, "tensors": len(header.tensors),
                            "metadata_keys": len(values)}
    for key in _SHOWN_KEYS:
        info[key.rsplit(".", 1)[-1] if key.startswith("general.") else key] = _value(values.get(key))
    arch = info.get("architecture")
    for key in ("context_length", "block_count", "embedding_length", "expert_count"):
        info[key] = _value(values.get(f"{arch}.{key}"))
    tokens = values.get("tokenizer.ggml.tokens")
    info["vocabulary"] = tokens.count if isinstance(tokens, GGUFArray) else 0
    info["chat_template"] = "tokenizer.chat_template" in values
    from gguf import GGML_QUANT_SIZES

    types: Counter[str] = Counter()
    for t in header.tensors:
        block, size = GGML_QUANT_SIZES[t.tensor_type]
        if t.offset + t.n_elements // block * size > header.size:
            raise CheckpointError(f"damaged GGUF file '{path}': tensor '{t.name[:80]}' runs past its end "
                                  "(truncated; `ckpt-train verify` checks every tensor)")
        types[t.tensor_type.name] += t.n_elements
    info["parameters"] = sum(types.values())
    info["types"] = dict(sorted(types.items()))
    return info


def _value(value: Any) -> Any:
    return f"(an array of {value.count})" if isinstance(value, GGUFArray) else value


@dataclass
class GGUFReport:
    path: Path
    problems: list[str] = field(default_factory=list)
    tensors: int = 0
    bytes: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_gguf(path: Path, *, decode: bool = True) -> GGUFReport:
    """Every tensor of a GGUF file inside it, sized for its type and shape, not overlapping the next; with
    ``decode``, every tensor dequantized (a block at a time) to finite values. A damaged header raises."""
    header = open_gguf(path)
    placed, problems = tensor_layout(header)
    report = GGUFReport(Path(path), problems, tensors=len(header.tensors), bytes=header.size)
    if not decode:
        return report
    fd = open_regular(Path(path), follow=True)
    try:
        for t, nbytes, block_bytes in placed:
            if not _finite(fd, t.offset, nbytes, block_bytes, t.tensor_type):
                report.problems.append(f"{t.name}: holds NaN or infinite values")
    finally:
        os.close(fd)
    return report


def tensor_layout(header: GGUFHeader) -> tuple[list[tuple[GGUFTensor, int, int]], list[str]]:
    """``(tensor, bytes, block bytes)`` of each tensor of whole blocks inside the file, by offset, and the problems (not
    whole blocks, past the end, overlapping the previous): without any, the tensors' bytes are at most the file's."""
    from gguf import GGML_QUANT_SIZES

    placed: list[tuple[GGUFTensor, int, int]] = []
    problems: list[str] = []
    end_of_last = header.data_offset
    for t in sorted(header.tensors, key=lambda t: t.offset):
        block, size = GGML_QUANT_SIZES[t.tensor_type]
        start, n = t.offset, t.n_elements
        want = n // block * size
        if start < end_of_last:
            problems.append(f"{t.name}: its bytes overlap the previous tensor's")
        if n % block or (t.dims and t.dims[0] % block):
            problems.append(f"{t.name}: {n} elements are no whole number of {t.tensor_type.name} blocks")
            continue
        if start + want > header.size:
            problems.append(f"{t.name}: {want} bytes of {t.tensor_type.name} data needed, the file ends first "
                            "(truncated)")
            continue
        end_of_last = start + want
        placed.append((t, want, size))
    return placed, problems


def refuse_misplaced_tensors(header: GGUFHeader, refusal: str) -> None:
    """A one-line ``CheckpointError`` naming the first of ``tensor_layout``'s problems and ``refusal`` (what is not
    done with the file), if any."""
    problems = tensor_layout(header)[1]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckpointError(f"damaged GGUF file '{header.path}': {problems[0]}{more}; {refusal} (`ckpt-train "
                              "verify` lists every problem)")


def _finite(fd: int, start: int, nbytes: int, block_bytes: int, tensor_type: Any) -> bool:
    """Whether the tensor's ``nbytes`` at ``start`` decode to finite values, read 16 MiB (whole blocks) at a time."""
    import numpy as np
    from gguf.quants import dequantize

    step = max(block_bytes, (1 << 24) // block_bytes * block_bytes)
    for lo in range(0, nbytes, step):
        chunk = os.pread(fd, min(step, nbytes - lo), start + lo)
        try:
            values = dequantize(np.frombuffer(chunk, dtype=np.uint8), tensor_type)
        except NotImplementedError:  # an integer type: every value is finite
            return True
        if not np.isfinite(values).all():
            return False
    return True
