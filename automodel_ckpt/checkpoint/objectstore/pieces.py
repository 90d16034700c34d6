"""A run folder's pieces on an object store: stable files stored once by content key, referenced, counted, collected.

With ``checkpoint.incremental`` each rank writes the tensors that do not train in a stable file of its own and
computes the file's content key while writing it (``ondisk.incremental``: 32 hex digits). On a local disk the next
checkpoint hard-links that file when its key is unchanged. An object store has no links, so the same sharing is
done by name: the file is uploaded once, as ``<run>/layout.PIECES_DIR/<key>``, and each checkpoint that holds it
lists it in its reference record ``<name>/layout.PIECE_REFS`` (``{"pieces_version": 1, "files": {file: key}}``)
instead of holding an object of its own. A hard link is the local form of the same thing: there the filesystem
names the bytes (an inode) and counts the names; here the key names the bytes and the records are the names.

- A save (every rank, its share, ``put``): a stable file whose piece is in the store with the file's size is not
  uploaded; a new one is, before the commit object. Rank 0 then writes the record, then the commit object (``run``).
- A fetch (``sources``) reads the record and downloads each listed file from its piece into the checkpoint's
  folder: every reader sees the folder as it was written. A referenced piece that is missing is one line naming it.
- A piece is deleted (``collect``) only when no record of the run folder names it (a committed checkpoint's, a
  quarantined one's, a leftover's: each counts), so only after the commit object of the last checkpoint naming it
  is gone: a kill at any point leaves at most unreferenced pieces (orphans), which the next save or ``ckpt-train
  gc`` collects. The pieces are listed before the records are read: a piece uploaded meanwhile is not taken.

A record is untrusted: its size is bounded (``bounded.INDEX_FILE_LIMIT``, as a manifest), every key must be 32 lowercase
hex digits (never a path: ``..`` or ``/`` in a key is refused here, since some stores accept them), and every file
it names must be one the checkpoint's manifest lists. Only objects below ``PIECES_DIR`` whose name is a key are
ever deleted.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterable

from automodel_ckpt.ondisk import bounded, layout
from automodel_ckpt.ondisk.incremental import key_of
from automodel_ckpt.checkpoint.objectstore.store import ObjectStore, mtime_of, now
from automodel_ckpt.errors import CheckpointError

KEY = re.compile(r"[0-9a-f]{32}")
_VERSION = 1
_WHAT = "a piece record"

# --- the record (pure) -------------------------------------------------------------------------------


def record_text(refs: dict[str, str]) -> str:
    """The reference record of a checkpoint whose files ``refs`` (file -> key) are stored as pieces."""
    return json.dumps({"pieces_version": _VERSION, "files": dict(sorted(refs.items()))}, indent=1) + "\n"


def parse_record(data: str | bytes, where: str, listed: Iterable[str] | None = None) -> dict[str, str]:
    """``{file: key}`` of the record read from ``where``. Each problem is one line: over ``bounded.INDEX_FILE_LIMIT`` or
    nested too deep, not JSON, not a record of this version, a key that is not 32 hex digits, a file that
    ``listed`` (the checkpoint manifest's files, when given) lacks."""
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
    """``({checkpoint: (own bytes, shared bytes)}, bytes stored)`` of the checkpoints whose files (``{file: size}``,
    their manifests') and records are given: a file stored as a piece that another of these checkpoints names too
    is shared; the bytes stored count each piece once."""
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
    """Every rank, its ``share`` of the staged checkpoint ``staging``: each stable file this process wrote there
    (``incremental.key_of``) stored as a piece; only those whose piece is not in the store with the file's size
    (``sizes``) are uploaded. Returns ``{file: (key, reused)}``; the other files of the share are the caller's."""
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
    """Checkpoint ``name``'s ``{file: key}`` (empty when it has no record: written whole, or before pieces
    existed); ``listed``: its manifest's files."""
    text = store.read_text(name, layout.PIECE_REFS, limit=bounded.INDEX_FILE_LIMIT)
    return {} if text is None else parse_record(text, f"'{store.url_of(name, layout.PIECE_REFS)}'", listed)


def present(store: ObjectStore) -> dict[str, dict[str, Any]]:
    """The pieces in the store, ``{key: listing entry}``, from one listing; an object there whose name is not a
    key is not a piece (never fetched, never deleted)."""
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
    """For the files ``rels`` of checkpoint ``name`` that ``refs`` stores as pieces: ``({file: object key},
    {file: listed size})``, from one listing. A piece missing from the store is one line naming it."""
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
    """``{prefix: {file: key}}`` of the prefixes ``names`` that hold a record (small reads, in one batch); a
    record that cannot be read as one is a ``CheckpointError`` naming it."""
    keys = {store.key(n, layout.PIECE_REFS): n for n in names}
    got = store.cat_small(list(keys), bounded.INDEX_FILE_LIMIT)
    return {keys[k]: parse_record(data, f"'{store.scheme}://{k}'") for k, data in got.items()}


def collect(store: ObjectStore, names: Iterable[str], min_age_seconds: float | None = None, *,
            dry_run: bool = False) -> list[str]:
    """Delete the pieces that no record of the prefixes ``names`` names; ``min_age_seconds``: only those written
    longer ago than that (a younger one may belong to a save in flight; one whose time the listing does not give is
    kept). Returns the keys deleted (with ``dry_run``, that would be)."""
    there = present(store)  # before the records: a piece uploaded from now on is not taken
    if not there:
        return []
    orphans = unreferenced(there, records(store, names).values())
    if min_age_seconds is not None:
        t = now()
        orphans = [k for k in orphans if (m := mtime_of(there[k])) is not None and t - m >= min_age_seconds]
    if orphans and not dry_run:
        store.fs.rm([piece_key(store, k) for k in orphans])
    return orphans
