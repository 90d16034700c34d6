"""Limits on what an untrusted file may ask for: JSON/YAML sizes and nesting, header and pickle sizes, counts.

``read_json`` / ``parse_json`` / ``read_yaml`` check size and nesting before a parser runs (docs/security.md)."""

from __future__ import annotations

import json
import os
import re
from itertools import accumulate
from pathlib import Path
from typing import Any

import yaml

from automodel_ckpt.ondisk import paths
from automodel_ckpt.errors import CheckpointError
from automodel_ckpt.shown import shown_value
from automodel_ckpt.sizes import human_size

MiB = 2**20
SMALL_FILE_LIMIT = 1 * MiB
"""``metadata.json``, pointers, quarantine notes, leases, upload and run markers, ``adapter_config.json``,
``.object-store.json``: a few KiB each."""
CONFIG_FILE_LIMIT = 16 * MiB
"""``config.json``, ``generation_config.json``, a checkpoint's ``config.yaml``: under 1 MiB for the largest
published models."""
INDEX_FILE_LIMIT = 64 * MiB
"""``manifest.json``, ``model.safetensors.index.json``, ``.hf_metadata`` tensor lists: about 100 bytes per tensor
or file; a 1T-parameter mixture of experts has some 10^5 tensors (10 to 20 MiB)."""
LOG_LINE_LIMIT = 1 * MiB
"""One line of ``training.jsonl`` / ``validation.jsonl`` / ``events.jsonl``."""
LOG_FILE_LIMIT = 256 * MiB
"""A whole training log pulled from a bucket: some 200 bytes a step, a million steps."""
SAFETENSORS_HEADER = 100_000_000
"""safetensors' own limit on a header (``safetensors`` refuses larger ones)."""
DCP_METADATA = 4096 * MiB
"""A DCP ``.metadata`` pickle: some 250 bytes per saved chunk (the chunk and where its bytes lie); Llama-3-70B's
AdamW state on 4,096 FSDP ranks has 5.9 million chunks (each moment cut in 4,096): about 1.4 GiB."""
MAX_DEPTH = 64
"""Nesting of JSON arrays and objects, YAML sequences and mappings: our own files nest 4 levels deep."""
MAX_SHAPE_DIMS = 64
"""Dimensions of one tensor (torch itself stops at 64)."""
MAX_WORLD_SIZE = 1 << 20
"""Ranks recorded as having written a checkpoint (``world_size`` in ``saved_state.json``, ``metadata.json``)."""
COUNT_LIMIT = 1 << 62
"""Every count read from a file (``is_count``) is below it: no file, tensor or run reaches it, and the sum of two
counts still fits an int64."""

_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_BRACKET = re.compile(rb"[\[\]{}]")


def is_count(value: object) -> bool:
    """A whole number from 0 to below ``COUNT_LIMIT`` (not a bool): a size, offset, dimension, step, counter."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < COUNT_LIMIT


def check_size(size: int, where: str, what: str, limit: int) -> None:
    """``CheckpointError`` when ``size`` bytes exceed ``limit``: "'x' is 80.0 MiB, over the 64.0 MiB limit for ..."."""
    if size > limit:
        raise CheckpointError(f"{where} is {human_size(size)}, over the {human_size(limit)} limit for {what}")


def read_bytes(path: Path, what: str, limit: int, *, follow: bool = False) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes; ``CheckpointError`` when larger."""
    where = f"'{path}'"
    with os.fdopen(paths.open_regular(Path(path), follow=follow), "rb") as f:
        check_size(os.fstat(f.fileno()).st_size, where, what, limit)
        data = f.read(limit + 1)  # a file that grows while read is still cut at the limit
    check_size(len(data), where, what, limit)
    return data


def depth_problem(data: bytes | str) -> str | None:
    """Why JSON text nests too deeply (None when not), from a linear scan, before the recursive parser starts."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    if raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH:
        return None
    brackets = _BRACKET.findall(_JSON_STRING.sub(b"", raw))
    deepest = max(accumulate(1 if b in (b"[", b"{") else -1 for b in brackets), default=0)
    return f"it nests {deepest} levels deep, over the limit of {MAX_DEPTH}" if deepest > MAX_DEPTH else None


def parse_json(data: bytes | str, where: str, what: str, limit: int | None = None) -> Any:
    """JSON ``data`` from ``where``, size and nesting checked first; problems: ``CheckpointError`` naming ``where``."""
    size = len(data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data)
    check_size(size, where, what, limit if limit is not None else INDEX_FILE_LIMIT)
    why = depth_problem(data)
    if why is not None:
        raise CheckpointError(f"{where} is unreadable as {what}: {why}")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"{where} is unreadable as {what}: not valid JSON ({str(exc).splitlines()[0][:200]})") \
            from None


def read_json(path: Path, what: str, limit: int, *, follow: bool = False) -> Any:
    """``parse_json`` of a file; ``OSError`` (``FileNotFoundError`` included) propagates as ``read_bytes``'s."""
    return parse_json(read_bytes(path, what, limit, follow=follow), f"'{path}'", what, limit)


def yaml_depth_line(text: str) -> int | None:
    """The line where YAML ``text`` nests deeper than ``MAX_DEPTH`` (or None), from PyYAML's non-recursive events."""
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            depth += 1
            if depth > MAX_DEPTH:
                return event.start_mark.line + 1
        elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            depth -= 1
    return None


def _parse_yaml(text: str, where: str, what: str) -> Any:
    """``yaml.safe_load`` of ``text`` from ``where``, refused in one line when too deep or not YAML."""
    try:
        line = yaml_depth_line(text)
        if line is not None:
            raise CheckpointError(f"{where} is unreadable as {what}: line {line} nests deeper than the limit of "
                                  f"{MAX_DEPTH} levels")
        return yaml.safe_load(text)
    except (yaml.YAMLError, RecursionError) as exc:
        raise CheckpointError(f"{where} is unreadable as {what}: not valid YAML ({str(exc).splitlines()[0][:200]})") \
            from None


def read_yaml(path: Path, what: str, limit: int = CONFIG_FILE_LIMIT, *, follow: bool = False) -> Any:
    """``_parse_yaml`` of a file of at most ``limit`` bytes; ``OSError`` propagates."""
    data = read_bytes(path, what, limit, follow=follow)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise CheckpointError(f"'{path}' is unreadable as {what}: not UTF-8 text") from None
    return _parse_yaml(text, f"'{path}'", what)


def check_count(value: object, where: str, field: str, limit: int, low: int = 0) -> int:
    """``value`` as a count (an int from ``low`` to ``limit``): else a one-line ``CheckpointError`` naming ``field``."""
    if not is_count(value) or not low <= value <= limit:
        raise CheckpointError(f"{where}: {field} is {shown_value(value)}, not a count from {low} to {limit}")
    return value
