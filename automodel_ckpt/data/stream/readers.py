"""Rows of one shard from a position, and rows fetched back by reference: json lines, plain text, parquet.

A row's reference (``key``) is what finds it again: the byte offset of its line (json lines, text; in a compressed
file, the offset in the decompressed stream, reached by decompressing up to it), or its row number (parquet: the row
group is found from the footer; Arrow IPC files: the record batches before it are read). Bad input never raises here: it comes back as a row whose
``error`` says what is wrong, so the stream decides whether to skip it (``data.skip_bad_rows``) or stop.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

from automodel_ckpt.data.stream.corpus import filesystem
from automodel_ckpt.errors import UserError


class DataError(UserError):
    """A streamed file or row that cannot be read: one line naming the file and the row."""


@dataclass
class Row:
    key: int  # where the row is found again (byte offset or row number)
    row: int  # its number in the file (0-based; for messages)
    record: dict[str, Any] | None = None
    error: str | None = None  # why the row (or the whole file, from here on) cannot be read
    next_key: int = 0  # the key of the row after it


def _open(path: str, storage_options: dict[str, Any] | None, compression: str | None = "infer") -> Any:
    fs, inner = filesystem(path, storage_options)
    return fs.open(inner, "rb", compression=compression)


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


def _lines(path: str, fmt: str, text_field: str, storage_options: dict[str, Any] | None, key: int,
           row: int) -> Iterator[Row]:
    try:
        f = _open(path, storage_options)
    except (OSError, ValueError) as exc:
        yield Row(key, row, error=f"cannot open ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
        return
    with f:
        try:
            if key:
                f.seek(key)
            for line in f:
                offset, key = key, key + len(line)
                if not line.strip():
                    continue
                record, error = _record_of(line, fmt, text_field)
                yield Row(offset, row, record, error, key)
                row += 1
        except (OSError, EOFError, ValueError) as exc:  # truncated compressed stream, a file gone mid-read
            yield Row(key, row, error=f"unreadable ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")


def _parquet_file(path: str, storage_options: dict[str, Any] | None) -> Any:
    import pyarrow.parquet as pq

    return pq.ParquetFile(_open(path, storage_options, compression=None))


def _group_starts(pf: Any) -> list[int]:
    starts = [0]
    for g in range(pf.metadata.num_row_groups):
        starts.append(starts[-1] + pf.metadata.row_group(g).num_rows)
    return starts


def _parquet(path: str, text_field: str, storage_options: dict[str, Any] | None, key: int,
             stop: int) -> Iterator[Row]:
    import bisect

    try:
        pf = _parquet_file(path, storage_options)
        starts = _group_starts(pf)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError, ...: all one line here
        yield Row(key, key, error=f"not a readable parquet file ({type(exc).__name__}: {str(exc).splitlines()[0]})")
        return
    first = max(bisect.bisect_right(starts, key) - 1, 0)
    end = starts[-1] if stop < 0 else min(stop, starts[-1])
    for g in range(first, len(starts) - 1):
        if starts[g] >= end:
            return
        try:
            rows = pf.read_row_group(g).to_pylist()
        except Exception as exc:  # noqa: BLE001
            yield Row(starts[g], starts[g], error=f"row group {g} unreadable ({type(exc).__name__}: "
                                                   f"{str(exc).splitlines()[0]})")
            return
        for i in range(max(key - starts[g], 0), min(len(rows), end - starts[g])):
            r = starts[g] + i
            yield Row(r, r, rows[i], None, r + 1)


def _arrow_batches(path: str, storage_options: dict[str, Any] | None) -> Iterator[tuple[int, list[dict[str, Any]]]]:
    """``(first row, rows)`` of each record batch of an Arrow IPC file (file or stream format, as the Hugging Face
    datasets cache writes them), in order."""
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


def _arrow(path: str, storage_options: dict[str, Any] | None, key: int) -> Iterator[Row]:
    try:
        for first, rows in _arrow_batches(path, storage_options):
            for i in range(max(key - first, 0), len(rows)):
                yield Row(first + i, first + i, rows[i], None, first + i + 1)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError, ...: all one line here
        yield Row(key, key, error=f"not a readable arrow file ({type(exc).__name__}: {str(exc).splitlines()[0]})")


def read_rows(path: str, fmt: str, text_field: str, storage_options: dict[str, Any] | None, key: int = 0,
              row: int = 0, stop: int = -1) -> Iterator[Row]:
    """The rows of ``path`` from the one at ``key`` (numbered from ``row``), in file order; parquet: up to row
    ``stop`` (a row-group shard's end; -1: the file's)."""
    if fmt == "parquet":
        return _parquet(path, text_field, storage_options, key, stop)
    if fmt == "arrow":
        return _arrow(path, storage_options, key)
    return _lines(path, fmt, text_field, storage_options, key, row)


def fetch_rows(path: str, fmt: str, text_field: str, storage_options: dict[str, Any] | None,
               keys: Iterable[int]) -> dict[int, dict[str, Any]]:
    """The texts of the rows at ``keys`` (a resume's shuffle buffer and packing carry-over): one read each, or one
    per row group; ``DataError`` if one cannot be read back (the file changed)."""
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
                    record, error = _record_of(f.readline(), fmt, text_field)
                    if error or record is None:
                        raise DataError(f"{path}: the row at byte {k} no longer reads ({error}); the file changed "
                                        "since the checkpoint")
                    out[k] = record
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise DataError(f"{path}: cannot read back rows of the checkpointed position "
                        f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
    return out
