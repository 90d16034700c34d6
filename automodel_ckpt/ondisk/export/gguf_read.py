"""Reading a GGUF file that may be hostile: its header and metadata for `inspect`, every tensor for `verify`.

The ``gguf`` library's ``GGUFReader`` does the parsing, after the input is bounded: the magic and version are
checked, and the tensor and key counts of the header must fit the file (each entry takes bytes of its own, so a
count larger than the file is a lie, refused before the reader loops over it). The reader maps the file and walks
it once; whatever it meets past the end (a truncated file, a string or array longer than what is left) is one
``CheckpointError`` line naming the file. ``verify_gguf`` then checks what the reader does not: every tensor's
bytes lie inside the file, in order, without overlap, sized for its type and shape, and decode to finite values.
"""

from __future__ import annotations

import os
import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from automodel_ckpt.ondisk import paths
from automodel_ckpt.errors import CheckpointError, first_line

__all__ = ["GGUF_MAGIC", "describe_gguf", "is_gguf", "open_gguf", "verify_gguf"]

GGUF_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_MIN_KV_BYTES = 8 + 1 + 4 + 1  # key length, a one-byte key, the value type, a one-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 8 + 4 + 8  # name length, name, dims, one dim, type, offset
_MAX_COUNT = 1 << 24  # entries of either kind: real models have under 10^4 tensors and 10^2 keys
_SHOWN_KEYS = ("general.architecture", "general.name", "general.file_type", "tokenizer.ggml.model",
               "tokenizer.ggml.pre")


def is_gguf(path: Path) -> bool:
    """Whether ``path`` is a file named ``*.gguf`` or starting with the GGUF magic (a ``.gguf`` file without it is
    then refused by ``open_gguf`` for what it is, rather than read as something else)."""
    from automodel_ckpt.ondisk import layout

    try:
        if not Path(path).is_file():
            return False
        if Path(path).name.endswith(layout.GGUF_SUFFIX):
            return True
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def open_gguf(path: Path) -> Any:
    """A ``gguf.GGUFReader`` of ``path`` once its header is checked; ``CheckpointError`` in one line otherwise."""
    import gguf

    path = Path(path)
    try:
        fd = paths.open_regular(path, follow=True)
    except FileNotFoundError:
        raise CheckpointError(f"the GGUF file '{path}' does not exist") from None
    except OSError as exc:
        raise CheckpointError(f"the GGUF file '{path}' cannot be read: {first_line(exc)}") from None
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, 24, 0)
    finally:
        os.close(fd)
    if len(head) < 24 or head[:4] != GGUF_MAGIC:
        raise CheckpointError(f"'{path}' is not a GGUF file (no GGUF magic and header in its first 24 bytes)")
    version, n_tensors, n_kv = struct.unpack("<IQQ", head[4:])
    if version not in _VERSIONS:
        raise CheckpointError(f"'{path}' is GGUF version {version}; versions {', '.join(map(str, _VERSIONS))} are read")
    room = size - 24
    if n_kv > min(_MAX_COUNT, room // _MIN_KV_BYTES):
        raise CheckpointError(f"'{path}' claims {n_kv} metadata keys, more than its {size} bytes can hold")
    if n_tensors > min(_MAX_COUNT, room // _MIN_TENSOR_INFO_BYTES):
        raise CheckpointError(f"'{path}' claims {n_tensors} tensors, more than its {size} bytes can hold")
    try:
        return gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, TypeError, OverflowError, MemoryError, struct.error,
            UnicodeDecodeError) as exc:
        raise CheckpointError(f"damaged GGUF file '{path}': {first_line(exc) or type(exc).__name__} (truncated, or "
                              "a length that runs past its end)") from None


def describe_gguf(path: Path) -> dict[str, Any]:
    """What `inspect` shows of a GGUF file: architecture, name, types of its tensors, parameters, tokenizer."""
    reader = open_gguf(path)
    fields = reader.fields
    info: dict[str, Any] = {"gguf": str(path), "bytes": Path(path).stat().st_size, "tensors": len(reader.tensors),
                            "metadata_keys": len(fields) - 3}
    for key in _SHOWN_KEYS:
        info[key.rsplit(".", 1)[-1] if key.startswith("general.") else key] = _value(fields.get(key))
    arch = info.get("architecture")
    for key in ("context_length", "block_count", "embedding_length", "expert_count"):
        info[key] = _value(fields.get(f"{arch}.{key}"))
    tokens = fields.get("tokenizer.ggml.tokens")
    info["vocabulary"] = len(tokens.data) if tokens is not None else 0
    info["chat_template"] = "tokenizer.chat_template" in fields
    types: Counter[str] = Counter()
    params = 0
    for t in reader.tensors:
        types[t.tensor_type.name] += int(t.n_elements)
        params += int(t.n_elements)
    info["parameters"] = params
    info["types"] = dict(sorted(types.items()))
    return info


def _value(field_: Any) -> Any:
    if field_ is None:
        return None
    try:
        value = field_.contents()
    except (ValueError, IndexError, UnicodeDecodeError):
        return "(unreadable)"
    return value if isinstance(value, (str, int, float, bool)) else str(value)[:80]


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
    import numpy as np
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    reader = open_gguf(path)
    report = GGUFReport(Path(path), tensors=len(reader.tensors), bytes=Path(path).stat().st_size)
    end_of_last = reader.data_offset
    for t in sorted(reader.tensors, key=lambda t: int(t.data_offset)):
        block, size = GGML_QUANT_SIZES.get(t.tensor_type, (None, None))
        if block is None:
            report.problems.append(f"{t.name}: unknown type {t.tensor_type}")
            continue
        start = int(t.data_offset)
        want = int(t.n_elements) // block * size
        if start < end_of_last:
            report.problems.append(f"{t.name}: its bytes overlap the previous tensor's")
        if start + want > report.bytes or int(t.n_bytes) != want or t.data.nbytes != want:
            report.problems.append(f"{t.name}: {want} bytes of {t.tensor_type.name} data needed, the file ends first "
                                   "(truncated)")
            continue
        end_of_last = start + want
        if decode:
            flat = np.asarray(t.data).reshape(-1).view(np.uint8)
            step = max(size, (1 << 24) // size * size)
            for lo in range(0, flat.size, step):
                values = dequantize(flat[lo:lo + step], t.tensor_type)
                if not np.isfinite(values).all():
                    report.problems.append(f"{t.name}: holds NaN or infinite values")
                    break
    return report
