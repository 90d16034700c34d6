"""A ``.distcp`` folder's ``.metadata`` file, its pickle kept across saves of an unchanged layout.

Torch's ``FileSystemWriter.finish`` pickles the whole ``Metadata`` at every save: every chunk of every tensor and
every item's storage location, millions of objects at thousands of ranks (an optimizer's moments: two chunks a
parameter a rank), although a save of the same layout writes the same ones. Only ``storage_meta`` (the folder and
the save's id) changes from save to save.

So the file is written as two pickled parts that load as one ``Metadata``: the **body**, everything but
``storage_meta`` (pickled once and kept while the layout and the write results are unchanged), and a **tail** that
sets ``storage_meta`` on it (a second ``BUILD``, the same opcode the body ends with). ``pickle.load``, DCP's
reader and ``safe_load.load_dcp_metadata`` read it as the same object torch's writer would have written.

The body is reused only when the coordinator reused its cached plan (the same ``state_dict_metadata`` and
``planner_data`` objects: ``planning``'s cache) and every rank's write results are those of the last save (their
digests: ``plan_results``); it is taken out of the cache while a save is on and put back once its file is written,
so a failed save leaves nothing stale.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from torch.distributed.checkpoint.metadata import Metadata

from automodel_ckpt.ondisk.fastio import metapickle

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
    """The body of ``metadata``'s file (its ``version`` set by the caller) with the storage data of ``results``
    (called only when the body is not reused), and what to call once the file is written (the body is kept).
    ``stamp``: every rank's write-results digest, None when some rank's results have none. ``rows``: the same
    results as ``plan_results`` tuples, written without making their objects where ``metapickle`` can; else
    ``results`` makes them."""
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
    """The opcodes that set ``storage_meta`` on the body's object, then end the pickle. Its memo slots start at 0
    again: they replace the body's, which nothing after the body reads."""
    part = pickle.dumps({"storage_meta": storage_meta}, protocol=_PROTOCOL)
    return part[2:-1] + _BUILD + _STOP  # without its PROTO header and STOP


def write(path: Path, data: bytes, end: bytes, *, sync: bool) -> None:
    """``data`` then ``end`` into ``path`` through a temporary file renamed over it, fsynced when ``sync``: as
    ``FileSystemWriter.finish`` writes the file."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.write(end)
        if sync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
