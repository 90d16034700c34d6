"""A run folder's pieces on an object store: stable files stored once by content key, referenced, counted, collected.

An object store has no hard links, so ``checkpoint.incremental``'s stable files are shared by name, each checkpoint
listing its pieces in a record (docs/object-storage.md). A piece is deleted only when no record names it, and the
pieces are listed before the records are read: a kill leaves at most orphans. A record is untrusted (bounded, keys
of 32 hex digits, never a path, files its manifest lists); only objects named by a key are ever deleted.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any, Iterable

from automodel_ckpt.ondisk import bounded, layout
from automodel_ckpt.ondisk.incremental import key_of
from automodel_ckpt.checkpoint.objectstore.store import ObjectStore, mtime_of
from automodel_ckpt.errors import CheckpointError

KEY = re.compile(r"[0-9a-f]{32}")
_VERSION = 1
_WHAT = "a piece record"

# --- the record (pure) -------------------------------------------------------------------------------


def record_text(refs: dict[str, str]) -> str:
    """The reference record of a checkpoint whose files ``refs`` (file -> key) are stored as pieces."""
    return json.dumps({"pieces_version": _VERSION, "files": dict(sorted(refs.items()))}, indent=1) + "\n"


def parse_record(data: str | bytes, where: str, listed: Iterable[str] | None = None) -> dict[str, str]:
    """``{file: key}`` of the record read from ``where``, each problem one line; ``listed``: the manifest's files."""
    table = bounded.parse_json(data, where, _WHAT, bounded.INDEX_FILE_LIMIT)
    if not isinstance(table, dict) or table.get("pieces_version") != _VERSION or not isinstance(table.get("files"),
                                                                                              dict):
        raise CheckpointError(f"{where} is not {_WHAT} this version reads (pieces_version {_VERSION} and a 'files' "
                              "table)")
    known = None if listed is None else set(listed)
    refs: dict[str, str] = {}
    for rel, key in table["files"].items():
        if not isinstance(key, str) or not KEY.fullmatch(key):
            raise CheckpointError(f"{where} gives {str(key)[:80]!r} as the piece of '{rel[:200]}', which is not a "
                                  "piece key (32 hex digits); the record is damaged or was not written by ckpt-train")
        if known is not None and rel not in known:
            raise CheckpointError(f"{where} names '{rel[:200]}', a file that the checkpoint's "
                                  f"{layout.MANIFEST_FILE} does not list")
        refs[rel] = key
    return refs


def unreferenced(pieces: Iterable[str], records: Iterable[dict[str, str]]) -> list[str]:
    """The pieces that no record names, sorted: what may be deleted (their reference count is 0)."""
    named = {key for refs in records for key in refs.values()}
    return sorted(set(pieces) - named)


def sharing(files: dict[str, dict[str, int]],
            records: dict[str, dict[str, str]]) -> tuple[dict[str, tuple[int, int]], int]:
    """``({checkpoint: (own bytes, shared bytes)}, bytes stored)``, a piece two name shared and stored once."""
    users: dict[str, set[str]] = {}
    for name, refs in records.items():
        for key in refs.values():
            users.setdefault(key, set()).add(name)
    shares: dict[str, tuple[int, int]] = {}
    stored, piece_size = 0, {}
    for name, sizes in files.items():
        refs = records.get(name, {})
        shared = sum(size for rel, size in sizes.items() if rel in refs and len(users[refs[rel]]) > 1)
        shares[name] = (sum(sizes.values()) - shared, shared)
        stored += sum(size for rel, size in sizes.items() if rel not in refs)
        piece_size.update({refs[rel]: size for rel, size in sizes.items() if rel in refs})
    return shares, stored + sum(piece_size.values())


# --- the store ---------------------------------------------------------------------------------------


def piece_key(store: ObjectStore, key: str) -> str:
    """The object key of piece ``key`` (a checked key: never a path)."""
    if not KEY.fullmatch(key):
        raise CheckpointError(f"{key[:80]!r} is not a piece key (32 hex digits)")
    return store.key(layout.PIECES_DIR, key)


def put(store: ObjectStore, staging: Path, share: list[str], sizes: dict[str, int]) -> dict[str, tuple[str, bool]]:
    """Every rank: its ``share``'s stable files as pieces, uploaded only where new; ``{file: (key, reused)}``."""
    refs: dict[str, tuple[str, bool]] = {}
    new: dict[str, str] = {}  # file -> its piece's object key
    for rel in share:
        key = key_of(Path(staging) / rel)
        if key is None:
            continue
        target = piece_key(store, key)
        try:
            there = int(store.fs.info(target)["size"]) == sizes[rel]
        except FileNotFoundError:
            there = False
        there = there or target in new.values()  # the same bytes twice in this share: uploaded once
        refs[rel] = (key, there)
        if not there:
            new[rel] = target
    store.upload(Path(staging), list(new), "", keys=new)
    return refs


def write_record(store: ObjectStore, name: str, refs: dict[str, str]) -> None:
    """Rank 0, before the commit object: checkpoint ``name``'s record."""
    store.write_text(record_text(refs), name, layout.PIECE_REFS)


def read_record(store: ObjectStore, name: str, listed: Iterable[str]) -> dict[str, str]:
    """Checkpoint ``name``'s ``{file: key}`` (empty without a record); ``listed``: its manifest's files."""
    text = store.read_text(name, layout.PIECE_REFS, limit=bounded.INDEX_FILE_LIMIT)
    return {} if text is None else parse_record(text, f"'{store.url_of(name, layout.PIECE_REFS)}'", listed)


def present(store: ObjectStore) -> dict[str, dict[str, Any]]:
    """The pieces in the store, ``{key: listing entry}``, from one listing; other names there are no pieces."""
    head = store.key(layout.PIECES_DIR).lstrip("/") + "/"
    found = {}
    for info in store.objects(layout.PIECES_DIR):
        name = str(info["name"]).lstrip("/")
        key = name[len(head):] if name.startswith(head) else ""
        if KEY.fullmatch(key):
            found[key] = info
    return found


def sources(store: ObjectStore, name: str, refs: dict[str, str],
            rels: Iterable[str]) -> tuple[dict[str, str], dict[str, int]]:
    """``({file: object key}, {file: listed size})`` of ``rels`` stored as pieces; a missing one is one line."""
    wanted = {rel: refs[rel] for rel in rels if rel in refs}
    if not wanted:
        return {}, {}
    there = present(store)
    for rel, key in sorted(wanted.items()):
        if key not in there:
            raise CheckpointError(f"'{store.url_of(name, rel)}' is stored as the piece "
                                  f"'{store.url_of(layout.PIECES_DIR, key)}', which is missing from the store; "
                                  "this checkpoint cannot be read whole: restore from another one")
    return ({rel: piece_key(store, key) for rel, key in wanted.items()},
            {rel: int(there[key].get("size") or 0) for rel, key in wanted.items()})


def records(store: ObjectStore, names: Iterable[str]) -> dict[str, dict[str, str]]:
    """``{prefix: {file: key}}`` of the prefixes ``names`` that hold a record, read in one batch."""
    keys = {store.key(n, layout.PIECE_REFS): n for n in names}
    got = store.cat_small(list(keys), bounded.INDEX_FILE_LIMIT)
    return {keys[k]: parse_record(data, f"'{store.scheme}://{k}'") for k, data in got.items()}


def collect(store: ObjectStore, names: Iterable[str], min_age_seconds: float | None = None, *,
            dry_run: bool = False) -> list[str]:
    """Delete the pieces no record of ``names`` names (with ``min_age_seconds``: only older, dated ones)."""
    there = present(store)  # before the records: a piece uploaded from now on is not taken
    if not there:
        return []
    orphans = unreferenced(there, records(store, names).values())
    if min_age_seconds is not None:
        t = time.time()
        orphans = [k for k in orphans if (m := mtime_of(there[k])) is not None and t - m >= min_age_seconds]
    if orphans and not dry_run:
        store.fs.rm([piece_key(store, k) for k in orphans])
    return orphans
