"""A ``.distcp`` folder's ``.metadata`` file, its pickle kept across saves of an unchanged layout.

A **body** kept while the plan and results are unchanged, and a **tail** that sets ``storage_meta``."""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from torch.distributed.checkpoint.metadata import Metadata

from automodel_ckpt.ondisk import durable
from automodel_ckpt.ondisk.fastio import metapickle
from automodel_ckpt.ondisk.fastio.filewrite import write_file

_PROTOCOL = 3  # no framing: the body's opcodes can be followed by the tail's
_BUILD, _STOP = pickle.BUILD, pickle.STOP


@dataclass
class _Body:
    entries: Any  # the metadata's ``state_dict_metadata`` (the object, compared by identity)
    planner_data: Any
    stamp: tuple[str, ...]  # every rank's write-results digest
    version: Any
    data: bytes  # the pickle of everything but ``storage_meta``, without its STOP


_BODIES: dict[str, _Body] = {}  # cache key (``sharded.cache_key``) -> the last save's body


def clear_cache() -> None:
    _BODIES.clear()


def body(metadata: Metadata, results: Callable[[], list[list[Any]]], key: str | None,
         stamp: tuple[str, ...] | None,
         rows: Callable[[], metapickle.StorageRows | None] | None = None) -> tuple[bytes, Callable[[], None]]:
    """The body of ``metadata``'s file and what to call once the file is written (keeping it). ``results`` (or
    ``rows``, written without objects where ``metapickle`` can) is called only when the body is not reused;
    ``stamp``: every rank's write-results digest, or None."""
    cached = _BODIES.pop(key, None) if key is not None else None
    if (cached is not None and stamp is not None and cached.stamp == stamp
            and cached.entries is metadata.state_dict_metadata and cached.planner_data is metadata.planner_data
            and cached.version == metadata.version):
        fresh = cached
    else:
        table = rows() if rows is not None else None
        data = _pickled(metadata, table) if table is not None else None
        if data is None:
            storage: dict[Any, Any] = {}
            for rank_results in results():
                storage.update({r.index: r.storage_data for r in rank_results})
            data = _pickled(metadata, storage)
        assert data is not None and data.endswith(_STOP)
        fresh = _Body(metadata.state_dict_metadata, metadata.planner_data, stamp or (), metadata.version, data[:-1])

    def kept() -> None:
        if key is not None and stamp is not None:
            _BODIES[key] = fresh

    return fresh.data, kept


def _pickled(metadata: Metadata, storage: Any) -> bytes | None:
    """``metapickle.dumps`` of ``metadata`` with ``storage`` as its storage data and no ``storage_meta``."""
    saved = (metadata.storage_data, metadata.storage_meta)
    metadata.storage_data, metadata.storage_meta = storage, None
    try:
        return metapickle.dumps(metadata, protocol=_PROTOCOL)
    finally:
        metadata.storage_data, metadata.storage_meta = saved


def tail(storage_meta: Any) -> bytes:
    """The opcodes that set ``storage_meta`` on the body's object and end the pickle (memo slots from 0 again)."""
    part = pickle.dumps({"storage_meta": storage_meta}, protocol=_PROTOCOL)
    return part[2:-1] + _BUILD + _STOP  # without its PROTO header and STOP


def write(path: Path, data: bytes, end: bytes, *, sync: bool, threads: int = 1,
          written: durable.WrittenFiles | None = None) -> None:
    """``data`` then ``end`` into ``path`` as ``FileSystemWriter.finish`` writes it, noted in ``written``; fsynced when
    ``sync``, then by ``write_file`` (a large file past the page cache, hashed as it is written)."""
    tmp, mine = path.with_name(path.name + ".tmp"), durable.WrittenFiles()
    if sync:
        write_file(tmp, [data, end], threads, mine)
    else:
        with open(tmp, "wb") as f:
            f.write(data)
            f.write(end)
    known = mine.get(tmp)
    os.replace(tmp, path)
    if written is not None:
        written.note(path, synced=sync, algorithm=known and known.algorithm, digest=known and known.digest)
