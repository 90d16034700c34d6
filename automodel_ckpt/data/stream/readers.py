"""Rows of one shard from a position, and rows fetched back by reference: json lines, plain text, parquet.

A row's reference (``key``) is the byte offset of its line (in a compressed file, in the decompressed stream) or its
row number (parquet, Arrow). Bad input never raises here: it comes back as a row whose ``error`` says what is wrong,
and the stream decides whether to skip it. Only regular files are opened (a FIFO, a device or a socket is a bad
file), and a row longer than ``max_bytes`` is read through in chunks, never held, and is a bad row.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Iterable, Iterator

from automodel_ckpt.data.stream.corpus import filesystem
from automodel_ckpt.data.stream.regular import NotRegularFile, open_regular
from automodel_ckpt.errors import UserError


#: The longest line or row a streamed corpus reads, in bytes, when ``data.max_record_bytes`` does not say.
MAX_RECORD_BYTES = 32 * 2**20
_CHUNK = 2**20  # bytes read at a time by the bounded line reader
_BATCH_ROWS = 1024  # parquet rows turned into records at a time


class DataError(UserError):
    """A streamed file or row that cannot be read: one line naming the file and the row."""


def malformed(what: str) -> DataError:
    """A checkpoint's data position that is not one a run writes: what of it, in one line."""
    return DataError(f"the checkpoint's data position is malformed ({what}); resume from another checkpoint")


@dataclass
class Row:
    key: int  # where the row is found again (byte offset or row number)
    row: int  # its number in the file (0-based; for messages)
    record: dict[str, Any] | None = None
    error: str | None = None  # why the row (or the whole file, from here on) cannot be read
    next_key: int = 0  # the key of the row after it


def _open(path: str, storage_options: dict[str, Any] | None, compression: str | None = "infer") -> Any:
    fs, inner = filesystem(path, storage_options)
    if "file" not in (fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)):
        return fs.open(inner, "rb", compression=compression)  # an object store: its objects are regular files
    from fsspec.compression import compr
    from fsspec.core import get_compression

    f = open_regular(inner)
    kind = get_compression(inner, compression) if compression is not None else None
    return f if kind is None else compr[kind](f, mode="rb")


def _why(exc: BaseException) -> str:
    """An exception as a few words of a bad row's message."""
    if isinstance(exc, NotRegularFile):
        return str(exc)
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def bounded_lines(f: Any, max_bytes: int) -> Iterator[tuple[bytes | None, int]]:
    """``(line, length)`` of each line of ``f`` from where it is; ``line`` is None for one over ``max_bytes``."""
    pieces: list[bytes] = []
    held, over = 0, False
    while True:
        chunk = f.read(_CHUNK)
        if not chunk:
            if held:
                yield (None if over else b"".join(pieces)), held
            return
        start = 0
        while True:
            nl = chunk.find(b"\n", start)
            end = len(chunk) if nl < 0 else nl + 1
            if not over and held + (end - start) - (nl >= 0) > max_bytes:
                over, pieces = True, []
            if not over:
                pieces.append(chunk[start:end])
            held += end - start
            if nl < 0:
                break
            yield (None if over else b"".join(pieces)), held
            pieces, held, over = [], 0, False
            start = end


def too_long(length: int, offset: int, max_bytes: int) -> str:
    """A bad row's reason for a line or row over ``data.max_record_bytes``."""
    return (f"a record of {length} bytes at byte {offset}, over data.max_record_bytes ({max_bytes}); raise it "
            "to read such records")


def record_size(value: Any) -> int:
    """About how many bytes a parquet or arrow record holds: the lengths of its strings and bytes, 8 a scalar."""
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, dict):
        return sum(record_size(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(record_size(v) for v in value)
    return 8


def _record_of(line: bytes, fmt: str, text_field: str) -> tuple[dict[str, Any] | None, str | None]:
    """``(record, error)`` of one line of a json-lines file (an object) or a text file (``{text_field: line}``)."""
    if fmt == "text":
        return {text_field: line.decode("utf-8", errors="replace").rstrip("\r\n")}, None
    try:
        record = json.loads(line)
    except ValueError as exc:
        return None, f"bad JSON ({str(exc).splitlines()[0]})"
    if not isinstance(record, dict):
        return None, f"not a JSON object ({type(record).__name__})"
    return record, None


def _opened(path: str, storage_options: dict[str, Any] | None, key: int, row: int) -> tuple[Any, Row | None]:
    """``path`` opened, or the bad row that says why it cannot be (not a regular file, or the open failed)."""
    try:
        return _open(path, storage_options), None
    except NotRegularFile as exc:
        return None, Row(key, row, error=str(exc))
    except (OSError, ValueError) as exc:
        return None, Row(key, row, error=f"cannot open ({_why(exc)})")


def _lines(path: str, fmt: str, text_field: str, storage_options: dict[str, Any] | None, key: int,
           row: int, max_bytes: int, stop: int | None = None) -> Iterator[Row]:
    """The rows of a line file from the line at ``key`` (with ``stop``: those starting before it)."""
    f, failed = _opened(path, storage_options, key, row)
    if failed is not None:
        yield failed
        return
    with f:
        try:
            if key:
                f.seek(key)
            if stop is not None and key >= stop:
                return
            for line, length in bounded_lines(f if stop is None else _UpTo(f, key, stop), max_bytes):
                offset, key = key, key + length
                if line is None:
                    yield Row(offset, row, None, too_long(length, offset, max_bytes), key)
                    row += 1
                elif line.strip():
                    record, error = _record_of(line, fmt, text_field)
                    yield Row(offset, row, record, error, key)
                    row += 1
                if stop is not None and key >= stop:
                    return
        except (OSError, EOFError, ValueError) as exc:  # truncated compressed stream, a file gone mid-read
            yield Row(key, row, error=f"unreadable ({_why(exc)})")


def _parquet_file(path: str, storage_options: dict[str, Any] | None) -> Any:
    import pyarrow.parquet as pq

    return pq.ParquetFile(_open(path, storage_options, compression=None))


def _group_starts(pf: Any) -> list[int]:
    return [0, *accumulate(pf.metadata.row_group(g).num_rows for g in range(pf.metadata.num_row_groups))]


def _parquet(path: str, text_field: str, storage_options: dict[str, Any] | None, key: int,
             stop: int, max_bytes: int) -> Iterator[Row]:
    import bisect

    try:
        pf = _parquet_file(path, storage_options)
        starts = _group_starts(pf)
    except NotRegularFile as exc:
        yield Row(key, key, error=str(exc))
        return
    except Exception as exc:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError, ...: all one line here
        yield Row(key, key, error=f"not a readable parquet file ({_why(exc)})")
        return
    first = max(bisect.bisect_right(starts, key) - 1, 0)
    end = starts[-1] if stop < 0 else min(stop, starts[-1])
    for g in range(first, len(starts) - 1):
        if starts[g] >= end:
            return
        r = starts[g]
        try:
            for batch in pf.iter_batches(batch_size=_BATCH_ROWS, row_groups=[g], use_threads=False):
                if r + batch.num_rows <= key:  # before the position: not turned into records
                    r += batch.num_rows
                    continue
                for record in batch.to_pylist():
                    if r >= end:
                        return
                    if r >= key:
                        yield _sized(Row(r, r, record, None, r + 1), max_bytes)
                    r += 1
        except Exception as exc:  # noqa: BLE001
            yield Row(r, r, error=f"row group {g} unreadable ({_why(exc)})")
            return


def _arrow_batches(path: str, storage_options: dict[str, Any] | None) -> Iterator[tuple[int, list[dict[str, Any]]]]:
    """``(first row, rows)`` of each record batch of an Arrow IPC file (file or stream format), in order."""
    import pyarrow as pa

    f = _open(path, storage_options, compression=None)
    with f:
        try:
            reader = pa.ipc.open_file(f)
            batches: Iterator[Any] = (reader.get_batch(i) for i in range(reader.num_record_batches))
        except pa.ArrowInvalid:
            f.seek(0)
            batches = iter(pa.ipc.open_stream(f))
        first = 0
        for batch in batches:
            yield first, batch.to_pylist()
            first += batch.num_rows


def _sized(row: Row, max_bytes: int) -> Row:
    """``row``, or a bad row in its place if its record is larger than ``max_bytes``."""
    size = record_size(row.record)
    if size > max_bytes:
        return Row(row.key, row.row, None, f"a row of {size} bytes, over data.max_record_bytes ({max_bytes}); "
                                           "raise it to read such rows", row.next_key)
    return row


def _arrow(path: str, storage_options: dict[str, Any] | None, key: int, max_bytes: int) -> Iterator[Row]:
    try:
        for first, rows in _arrow_batches(path, storage_options):
            for i in range(max(key - first, 0), len(rows)):
                yield _sized(Row(first + i, first + i, rows[i], None, first + i + 1), max_bytes)
    except NotRegularFile as exc:
        yield Row(key, key, error=str(exc))
    except Exception as exc:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError, ...: all one line here
        yield Row(key, key, error=f"not a readable arrow file ({_why(exc)})")


def read_rows(path: str, fmt: str, text_field: str, storage_options: dict[str, Any] | None, key: int = 0,
              row: int = 0, stop: int = -1, max_bytes: int = MAX_RECORD_BYTES) -> Iterator[Row]:
    """The rows of ``path`` from the one at ``key`` (numbered from ``row``) up to row ``stop`` (-1: the end); of a
    line file, those starting before byte ``stop``."""
    if fmt == "parquet":
        return _parquet(path, text_field, storage_options, key, stop, max_bytes)
    if fmt == "arrow":
        return _arrow(path, storage_options, key, max_bytes)
    return _lines(path, fmt, text_field, storage_options, key, row, max_bytes, stop if stop >= 0 else None)


def fetch_rows(path: str, fmt: str, text_field: str, storage_options: dict[str, Any] | None,
               keys: Iterable[int], max_bytes: int = MAX_RECORD_BYTES) -> dict[int, dict[str, Any]]:
    """The texts of the rows at ``keys``; ``DataError`` if one cannot be read back (the file changed)."""
    wanted = sorted(set(keys))
    out: dict[int, dict[str, Any]] = {}
    if not wanted:
        return out
    try:
        if fmt == "parquet":
            import bisect

            pf = _parquet_file(path, storage_options)
            starts = _group_starts(pf)
            groups: dict[int, list[int]] = {}
            for k in wanted:
                groups.setdefault(bisect.bisect_right(starts, k) - 1, []).append(k)
            for g, ks in groups.items():
                rows = pf.read_row_group(g).to_pylist()
                out.update({k: rows[k - starts[g]] for k in ks})
        elif fmt == "arrow":
            keys_left = set(wanted)
            for first, rows in _arrow_batches(path, storage_options):
                for k in [k for k in keys_left if first <= k < first + len(rows)]:
                    out[k] = rows[k - first]
                    keys_left.discard(k)
                if not keys_left:
                    break
            if keys_left:
                raise DataError(f"{path}: row {min(keys_left)} of the checkpointed position is past the file's end; "
                                "the file changed since the checkpoint")
        else:
            with _open(path, storage_options) as f:
                for k in wanted:
                    f.seek(k)
                    line, length = next(bounded_lines(f, max_bytes), (b"", 0))
                    record, error = (None, too_long(length, k, max_bytes)) if line is None else \
                        _record_of(line, fmt, text_field)
                    if error or record is None:
                        raise DataError(f"{path}: the row at byte {k} no longer reads ({error}); the file changed "
                                        "since the checkpoint")
                    out[k] = record
        for k, record in out.items():
            if record_size(record) > max_bytes:
                raise DataError(f"{path}: the row at {k} of the checkpointed position is larger than "
                                f"data.max_record_bytes ({max_bytes})")
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise DataError(f"{path}: cannot read back rows of the checkpointed position ({_why(exc)})") from None
    return out


class _UpTo:
    """A binary file read in pieces that end at ``stop``, and past it in small ones (a range's last line)."""

    def __init__(self, f: Any, pos: int, stop: int) -> None:
        self.f, self.pos, self.stop = f, pos, stop

    def read(self, n: int = -1) -> bytes:
        left = self.stop - self.pos
        data = self.f.read(min(n, left) if left > 0 else min(n, 2**16))
        self.pos += len(data)
        return data


def line_start(path: str, storage_options: dict[str, Any] | None, offset: int,
               max_bytes: int = MAX_RECORD_BYTES) -> int:
    """The first line's offset at or after ``offset`` in a line file (``offset`` if unreadable: its reader says)."""
    if offset <= 0:
        return 0
    with contextlib.suppress(OSError, ValueError):
        with _open(path, storage_options) as f:
            f.seek(offset - 1)
            for _, length in bounded_lines(_UpTo(f, offset - 1, offset), max_bytes):
                return offset - 1 + length
    return offset
