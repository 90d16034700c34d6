"""The write results every rank sends the coordinator after a DCP save: compact, and cached across saves.

Sent as columns or tuples, or as a digest when unchanged since the last save under the key; the coordinator keeps
them as ``planning`` keeps plans, and a digest it does not hold fails the save."""

from __future__ import annotations

import hashlib
import pickle
from dataclasses import dataclass, replace
from typing import Any

from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from automodel_ckpt.distributed.dcp_private import StorageInfo
from automodel_ckpt.ondisk.fastio.metapickle import StorageRows
from automodel_ckpt.ondisk.fastio.records import NOTE
from automodel_ckpt.ondisk.saveplan.packed import Packed, Unpacker, items_packed
from automodel_ckpt.ondisk.saveplan.result_columns import ResultColumns, StorageColumns, joined, split


@dataclass(frozen=True)
class ResultsNote:
    """One rank's write results: their digest, and unless unchanged, their columns, tuples or objects."""

    digest: str
    tuples: list[tuple] | None = None
    objects: list[WriteResult] | None = None
    columns: ResultColumns | None = None

    @property
    def unchanged(self) -> bool:
        return self.tuples is None and self.objects is None and self.columns is None

    def rows(self) -> list[tuple] | None:
        """The results as ``encode``'s tuples, None where they were sent as objects."""
        return joined(self.columns) if self.columns is not None else self.tuples


_RANK: dict[tuple[str, int, int], str] = {}  # (key, world size, rank) -> the digest of its last results
_COORDINATOR: dict[tuple[str, int], list[ResultsNote]] = {}


def clear_cache() -> None:
    _RANK.clear()
    _COORDINATOR.clear()


def encode(results: list[WriteResult]) -> list[tuple] | None:
    """``(fqn, offset, index, size, file, offset in file, length, note)`` per result; None for other storage data."""
    out = []
    for r in results:
        info = r.storage_data
        if (type(info) is not StorageInfo or getattr(info, "transform_descriptors", None) is not None
                or set(vars(info)) - {"relative_path", "offset", "length", "transform_descriptors", NOTE}):
            return None
        i = r.index
        out.append((i.fqn, None if i.offset is None else tuple(i.offset), i.index, r.size_in_bytes,
                    info.relative_path, info.offset, info.length, getattr(info, NOTE, None)))
    return out


def decode(tuples: list[tuple]) -> list[WriteResult]:
    out = []
    for fqn, offset, index, size, file, at, length, note in tuples:
        info = StorageInfo(file, at, length)
        if note is not None:
            setattr(info, NOTE, note)
        out.append(WriteResult(index=MetadataIndex(fqn, offset, index), size_in_bytes=size, storage_data=info))
    return out


def outgoing(results: list[WriteResult], key: str | None, world_size: int, rank: int) -> ResultsNote:
    """What a rank sends the coordinator for its ``results``; ``succeeded(key, ..., note)`` once the save did."""
    tuples = encode(results)
    if tuples is None:
        return ResultsNote("", objects=results)
    digest = hashlib.blake2b(pickle.dumps(tuples, protocol=4), digest_size=16).hexdigest()
    last = _RANK.pop((key, world_size, rank), None) if key is not None else None  # back once the save succeeded
    if last == digest:
        return ResultsNote(digest)
    columns = split(tuples)
    if columns is None:
        return ResultsNote(digest, tuples)
    return ResultsNote(digest, columns=items_packed(columns))


def succeeded(key: str | None, world_size: int, rank: int, note: ResultsNote | None) -> None:
    """The save that sent ``note`` succeeded on every rank: its results are the ones to compare the next with."""
    if key is not None and note is not None and note.digest:
        _RANK[(key, world_size, rank)] = note.digest


def incoming(notes: list[Any], key: str | None, *, needed: bool) -> list[list[WriteResult]]:
    """Every rank's results on the coordinator: ``WriteResult`` lists where ``needed``, else empty lists."""
    full = _full_notes(notes, key)
    return notes if full is None else _expanded(full, needed)


def stamp(notes: list[ResultsNote]) -> tuple[str, ...] | None:
    """Every rank's results digest (what decides the storage data of the metadata), None where one has none."""
    digests = tuple(n.digest for n in notes)
    return digests if all(digests) else None


def _expanded(full: list[ResultsNote], needed: bool) -> list[list[WriteResult]]:
    if not needed:
        return [[] for _ in full]
    return [n.objects if n.objects is not None else decode(n.rows() or []) for n in full]


def rows(full: list[ResultsNote]) -> StorageRows | StorageColumns | None:
    """Every rank's results as sent (``StorageColumns``, else ``StorageRows``); None where a rank sent objects."""
    if any(n.objects for n in full):
        return None
    if all(n.columns is not None for n in full):
        return StorageColumns([n.columns for n in full])
    return StorageRows([n.rows() or [] for n in full])


def _full_notes(notes: list[Any], key: str | None) -> list[ResultsNote] | None:
    """Every rank's note whole (from the cache where it sent its digest only); None for DCP's own results."""
    cache_key = (key, len(notes)) if key is not None else None
    cached = _COORDINATOR.pop(cache_key, None) if cache_key is not None else None
    full: list[ResultsNote] = []
    unpacked = Unpacker()
    for rank, note in enumerate(notes):
        if not isinstance(note, ResultsNote):
            return None
        if not note.digest and note.objects is None:  # nothing sent: the writer's finish reads no results
            full.append(ResultsNote("", objects=[]))
            continue
        if note.unchanged:
            if cached is None or cached[rank].digest != note.digest:
                raise ValueError(f"rank {rank} sent unchanged write results that the coordinator does not hold")
            note = cached[rank]
        elif note.columns is not None and isinstance(note.columns.items, Packed):  # each distinct list read once
            note = replace(note, columns=unpacked.items(note.columns))
        full.append(note)
    if cache_key is not None and all(n.tuples is not None or n.columns is not None for n in full):
        _COORDINATOR[cache_key] = full
    return full


def keep_results(writer: Any, key: str | None, world_size: int, rank: int) -> Any:
    """Make ``writer`` send its results compact and ``finish`` read them whole; returns what to call on success."""
    write_data, finish = writer.write_data, writer.finish
    needed = not (isinstance(writer, HuggingFaceStorageWriter) and writer.save_distributed
                  and not writer.enable_consolidation)
    sent: list[ResultsNote] = []

    def compact(fut: Any) -> ResultsNote:
        results = fut.value()
        if not needed:  # per-rank safetensors shards: the coordinator's finish reads none, so none is sent
            return ResultsNote("")
        sent.append(outgoing(results, key, world_size, rank))
        return sent[-1]

    def compact_write_data(plan: Any, planner: Any) -> Any:
        return write_data(plan, planner).then(compact)

    def expanding_finish(metadata: Any, results: list[Any]) -> None:
        from automodel_ckpt.ondisk.saveplan.planning import gc_paused

        with gc_paused():  # millions of results and chunks at thousands of ranks, no cycles (see gc_paused)
            full = _full_notes(results, key)
            if full is None:
                finish(metadata, results)
            elif needed and hasattr(writer, "finish_kept"):  # a .distcp folder: its .metadata's pickle kept
                writer.finish_kept(metadata, lambda: _expanded(full, True), key, stamp(full), lambda: rows(full))
            else:
                finish(metadata, _expanded(full, needed))
        hollow(metadata)

    writer.write_data, writer.finish = compact_write_data, expanding_finish
    return lambda: succeeded(key, world_size, rank, sent[-1] if sent else None)


def hollow(metadata: Any) -> None:
    """Empty the ``Metadata`` a save's ``finish`` was given once its file is written: DCP then broadcasts it to
    every rank (``dcp.save``'s return, which nothing reads), every chunk of every tensor. It is the planner's
    shallow copy of its cached metadata, so only its attributes are replaced."""
    metadata.state_dict_metadata, metadata.planner_data, metadata.storage_data = {}, None, None
