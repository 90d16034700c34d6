"""A run folder on an object store worked through a local mirror: pull the catalog, fetch, upload, commit, prune, gc.

The mirror has the local layout, so selection, retention and loading run unchanged on it; the commit protocol and
the upload marker are docs/object-storage.md's.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any, Iterable

from automodel_ckpt.ondisk import bounded, layout, manifest
from automodel_ckpt.checkpoint.objectstore import pieces
from automodel_ckpt.checkpoint.objectstore.lease import Lease, break_lease
from automodel_ckpt.checkpoint.objectstore.location import normalize
from automodel_ckpt.checkpoint.objectstore.store import ObjectStore, wrap
from automodel_ckpt.ondisk.durable import read_pointer, remove_pointer, remove_tree, set_pointer
from automodel_ckpt.errors import CheckpointError
from automodel_ckpt.sizes import human_size

logger = logging.getLogger(__name__)

_LOGS = (layout.TRAINING_LOG, layout.VALIDATION_LOG, layout.EVENTS_LOG)


class RemoteRun:
    """``store`` (the run folder's URL) mirrored in the local folder ``mirror``."""

    def __init__(self, store: ObjectStore, mirror: Path) -> None:
        self.store = store
        self.mirror = Path(mirror)
        self.lease: Lease | None = None  # rank 0 of a training run: held from ``prepare`` to the end
        self._collected = False  # whether this process has collected unreferenced pieces yet (``collect_pieces``)

    @property
    def url(self) -> str:
        return self.store.url

    # --- start of a run or a verb: the catalog -------------------------------------------------------
    def prepare(self, key: str = "checkpoint.checkpoint_dir", lease: Lease | None = None) -> None:
        """Rank 0, before training: check access, take the lease, mark the URL as a run folder, pull the catalog."""
        problem = self.store.access_problem(key)
        if problem:
            raise CheckpointError(problem)
        self._claim_mirror()
        self.lease = lease or Lease(self.store, key)
        self.lease.acquire()
        try:
            self.lease.start_heartbeat()
            atexit.register(self.release)
            if not wrap(f"reading '{self.url}'", lambda: self.store.exists(layout.RUN_MARKER)):
                note = {"written_by": "automodel-ckpt", "first_run": time.time(), "host": socket.gethostname()}
                wrap(f"marking '{self.url}' as a run folder",
                     lambda: self.store.write_text(json.dumps(note) + "\n", layout.RUN_MARKER))
            self.pull()
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """End of the run (any rank; a no-op where no lease is held): stop the heartbeat and remove the lease."""
        if self.lease is not None:
            self.lease.release()

    def pull(self) -> list[str]:
        """Make the mirror list exactly the committed checkpoints (small files only), the pointers and the logs."""
        self._claim_mirror()
        self.mirror.mkdir(parents=True, exist_ok=True)
        (self.mirror / layout.OBJECT_STORE_SOURCE).write_text(json.dumps({"url": self.url}) + "\n", encoding="utf-8")
        _PULLED[os.path.realpath(self.mirror)] = self.url
        names = wrap(f"listing '{self.url}'", self._selectable)
        for entry in self.mirror.iterdir():  # uncommitted or deleted remotely: not a checkpoint here either
            if entry.is_dir() and not entry.is_symlink() and entry.name not in names \
                    and entry.name != layout.QUARANTINE_DIR and _made_here(entry):
                remove_tree(entry)
        wanted = [self.store.key(n, f) for n in names for f in layout.CATALOG_FILES]
        got = wrap(f"reading the catalog of '{self.url}'",
                   lambda: self.store.cat_small(wanted, bounded.INDEX_FILE_LIMIT))
        for name in names:
            folder = self.mirror / name
            remote_manifest = got.get(self.store.key(name, layout.MANIFEST_FILE))
            local_manifest = folder / layout.MANIFEST_FILE
            if local_manifest.is_file() and local_manifest.read_bytes() != remote_manifest:
                remove_tree(folder)  # another checkpoint of the same name: nothing cached of the old one is valid
            folder.mkdir(exist_ok=True)
            for file in layout.CATALOG_FILES:  # the commit object last
                data = got.get(self.store.key(name, file))
                if data is not None:
                    (folder / file).parent.mkdir(parents=True, exist_ok=True)
                    (folder / file).write_bytes(data)
        for pointer in layout.POINTERS:
            target = (self.store.read_text(pointer) or "").strip()
            if target in names:
                set_pointer(self.mirror, pointer, target)
            elif read_pointer(self.mirror, pointer) is not None:
                remove_pointer(self.mirror, pointer)
        for log in _LOGS:
            data = self.store.read_text(log, limit=bounded.LOG_FILE_LIMIT)
            if _extends(self.mirror / log, data or ""):
                continue  # this mirror's run went on past the store's copy (to a node-local step): keep its lines
            if data is None:
                (self.mirror / log).unlink(missing_ok=True)
            else:
                (self.mirror / log).write_text(data, encoding="utf-8")
        return names

    def _claim_mirror(self) -> None:
        """Refuse a mirror with files not ours (a pull removes folders): ours holds ``OBJECT_STORE_SOURCE``."""
        if self.mirror.is_dir() and not (self.mirror / layout.OBJECT_STORE_SOURCE).is_file() \
                and any(p.name != layout.RUN_LOCK for p in self.mirror.iterdir()):  # the lock: this run's own
            raise CheckpointError(
                f"checkpoint.staging_dir: '{self.mirror}' already holds files that ckpt-train did not write (no "
                f"{layout.OBJECT_STORE_SOURCE}); give an empty or new folder (ckpt-train removes folders in it)")

    def _selectable(self) -> list[str]:
        quarantined = set()
        qdir = self.store.key(layout.QUARANTINE_DIR)
        if self.store.fs.exists(qdir):
            quarantined = {p.rsplit("/", 1)[-1].removesuffix(".json") for p in self.store.fs.ls(qdir, detail=False)}
        return [n for n in self.store.committed() if n not in quarantined]

    def leftovers(self) -> list[str]:
        """Prefixes with the upload marker and no commit object: saves never committed, deletions interrupted."""
        return self._scan()[1]

    def _scan(self) -> tuple[list[str], list[str]]:
        names = [n for n in self.store.prefixes() if n != layout.QUARANTINE_DIR]
        committed = set(self.store.committed(names))
        return names, [n for n in names if n not in committed and self.store.exists(n, layout.UPLOAD_MARKER)]

    # --- a save ----------------------------------------------------------------------------------------
    def before_save(self, name: str) -> list[str]:
        """Rank 0, before a save: refuse an existing or foreign prefix ``name``, delete the leftovers (one save in
        flight at most: a marked prefix without a commit object is one) and write the upload marker first."""
        if self.lease is not None:
            self.lease.check()
        if wrap(f"checking '{self.store.url_of(name)}'", lambda: self.store.exists(name, layout.MANIFEST_FILE)):
            raise CheckpointError(
                f"checkpoint '{self.store.url_of(name)}' already exists and is never overwritten; "
                "restore from the newest checkpoint or use another checkpoint.checkpoint_dir"
            )
        names, leftovers = wrap(f"listing '{self.url}'", self._scan)
        for leftover in leftovers:
            wrap(f"deleting '{self.store.url_of(leftover)}'", lambda n=leftover: self.store.delete_prefix(n))
        if leftovers or not self._collected:  # what they named, or what a run killed while collecting left
            self.collect_pieces()
        if name in names and name not in leftovers and wrap(f"listing '{self.store.url_of(name)}'",
                                                             lambda: self.store.objects(name)):
            raise CheckpointError(
                f"checkpoint '{self.store.url_of(name)}' already holds objects that ckpt-train did not write (no "
                f"{layout.UPLOAD_MARKER}); they are never deleted: move them, or use another "
                "checkpoint.checkpoint_dir or checkpoint.name_template")
        marker = {"checkpoint": name, "started": time.time(), "host": socket.gethostname(), "pid": os.getpid()}
        wrap(f"starting the upload of '{self.store.url_of(name)}'",
             lambda: self.store.write_text(json.dumps(marker) + "\n", name, layout.UPLOAD_MARKER))
        return leftovers

    def upload_share(self, staging: Path, name: str, rank: int, world_size: int) -> dict[str, tuple[str, bool]]:
        """Every rank: upload its share of the staged files but the manifest, new stable files as pieces."""
        files = manifest.list_files(staging)
        share = manifest.assign(files, world_size)[rank]
        refs = wrap(f"uploading to '{self.store.url}/{layout.PIECES_DIR}'",
                    lambda: pieces.put(self.store, staging, share, files))
        rest = [rel for rel in share if rel not in refs]
        wrap(f"uploading to '{self.store.url_of(name)}'", lambda: self.store.upload(staging, rest, name))
        return refs

    def upload_commit_object(self, staging: Path, name: str, refs: dict[str, tuple[str, bool]] | None = None) -> None:
        """Rank 0, once every upload succeeded: the pieces' record, the logs (a rerun finds its steps logged), then the
        commit object; with pieces, ``linked_bytes`` is what was taken from stored pieces."""
        if refs:
            wrap(f"uploading '{self.store.url_of(name, layout.PIECE_REFS)}'",
                 lambda: pieces.write_record(self.store, name, {rel: key for rel, (key, _) in refs.items()}))
            table = manifest.read_manifest(staging) or {}
            reused = sum(int(table["files"][rel]["size"]) for rel, (_, kept) in refs.items() if kept)
            table.pop("linked_bytes", None)
            if reused:
                table["linked_bytes"] = reused
            manifest.write(staging, table)
        self.push_logs()
        wrap(f"committing '{self.store.url_of(name)}'",
             lambda: self.store.upload(staging, [layout.MANIFEST_FILE], name))

    def after_publish(self, final: Path) -> None:
        """Rank 0, once the mirror published ``final``: the pointers and logs, then ``evict``."""
        self.push_pointers()
        self.push_logs()
        self.evict(final)

    def push_pointers(self) -> None:
        for pointer in layout.POINTERS:
            target = read_pointer(self.mirror, pointer)
            if target is not None:
                wrap(f"setting {pointer} in '{self.url}'",
                     lambda p=pointer, t=target: self.store.write_text(t + "\n", p))
            else:
                wrap(f"removing {pointer} in '{self.url}'", lambda p=pointer: self.store.remove(p))

    def push_logs(self) -> None:
        rels = [log for log in _LOGS if (self.mirror / log).is_file()]
        wrap(f"uploading the logs to '{self.url}'", lambda: self.store.upload(self.mirror, rels, ""))

    def evict(self, folder: Path) -> None:
        """Drop the mirror's copy of a committed checkpoint's files, except the catalog files."""
        for rel in manifest.list_files(folder):
            if rel not in layout.CATALOG_FILES:
                (folder / rel).unlink(missing_ok=True)
        for sub in sorted((p for p in folder.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                sub.rmdir()

    # --- retention, quarantine, gc ---------------------------------------------------------------------
    def delete(self, names: list[str]) -> None:
        """Rank 0: delete committed checkpoints (commit object first), then the pieces none names any more."""
        for name in names:
            wrap(f"deleting '{self.store.url_of(name)}'", lambda n=name: self.store.delete_checkpoint(n))
        if names:
            self.collect_pieces()

    def collect_pieces(self) -> list[str]:
        """Rank 0, between saves: delete the pieces no record names (a failure, a warning, leaves orphans)."""
        try:
            deleted = wrap(f"collecting the unreferenced pieces of '{self.url}'",
                           lambda: pieces.collect(self.store, self.store.prefixes()))
        except CheckpointError as exc:
            logger.warning("%s; they stay until the next save or `ckpt-train gc`", exc)
            return []
        self._collected = True
        if deleted:
            logger.info("deleted %d unreferenced piece(s) from %s/%s", len(deleted), self.url, layout.PIECES_DIR)
        return deleted

    def quarantine(self, name: str, reason: str) -> None:
        """Rank 0: a note object marks ``name`` unloadable, never listed or selected again."""
        note = {"name": name, "reason": reason, "quarantined_at": time.time()}
        wrap(f"quarantining '{self.store.url_of(name)}'",
             lambda: self.store.write_text(json.dumps(note) + "\n", layout.QUARANTINE_DIR,
                                           layout.quarantine_note(name)))
        self.push_pointers()

    def break_lease(self) -> dict[str, Any] | None:
        """``ckpt-train gc --break-lease``: remove the lease whoever holds it; returns it."""
        return break_lease(self.store)

    def gc(self, min_age_seconds: float, *, dry_run: bool = False) -> list[str]:
        """Delete the leftovers older than ``min_age_seconds`` (younger: uploading); the names deleted."""
        deleted = []
        for name in wrap(f"listing '{self.url}'", self.leftovers):
            newest = self.store.newest_write(name)
            if newest is not None and time.time() - newest < min_age_seconds:
                logger.info("keeping '%s': written %.0f s ago, may still be uploading", name, time.time() - newest)
                continue
            if not dry_run:
                wrap(f"deleting '{self.store.url_of(name)}'", lambda n=name: self.store.delete_prefix(n))
            deleted.append(name)
        return deleted

    def piece_url(self, key: str) -> str:
        return self.store.url_of(layout.PIECES_DIR, key)

    def gc_pieces(self, min_age_seconds: float, *, dry_run: bool = False, gone: Iterable[str] = ()) -> list[str] | None:
        """Delete the pieces no record names, older than ``min_age_seconds`` (``dry_run``: list them, the prefixes
        ``gone`` counted as deleted); None while a live run holds the lease (its saves collect them)."""
        lease = Lease(self.store, "gc")
        current = lease.read()
        if current is not None and current.get("token") and not lease.free(current):
            return None
        skip = set(gone)
        return wrap(f"collecting the unreferenced pieces of '{self.url}'",
                    lambda: pieces.collect(self.store, [n for n in self.store.prefixes() if n not in skip],
                                           min_age_seconds, dry_run=dry_run))


def _extends(local: Path, remote: str) -> bool:
    """Whether the mirror's log ``local`` extends the store's copy ``remote``: node-local steps after the last push
    are logged only here (a copy that differs is the store's: another machine continued the run)."""
    expected = remote.encode("utf-8")
    try:
        with open(local, "rb") as f:
            return f.read(len(expected)) == expected and bool(f.read(1))
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return False


def _made_here(folder: Path) -> bool:
    """Whether a mirror subfolder is this project's: a checkpoint, a staging or deleting name, or empty."""
    if folder.name.startswith((layout.STAGING_PREFIX, layout.DELETING_PREFIX)):
        return True
    return (folder / layout.MANIFEST_FILE).is_file() or (folder / layout.METADATA_FILE).is_file() \
        or not any(folder.iterdir())


# --- loading: a checkpoint of the mirror is fetched before it is checked and loaded ------------------


_PULLED: dict[str, str] = {}  # mirror folder (real path) -> the URL this process pulled into it


def pulled_from(folder: Path) -> str | None:
    """The URL to fetch ``folder``'s files from, only for a mirror this process pulled: a folder's note never
    chooses where the user's credentials read (a folder received from elsewhere may name any bucket)."""
    return _PULLED.get(os.path.realpath(Path(folder).parent))


def source_of(folder: Path) -> str | None:
    """The run folder's URL from the mirror's note, for messages only (never to fetch); None for a local one."""
    note = Path(folder).parent / layout.OBJECT_STORE_SOURCE
    try:
        return str(bounded.read_json(note, "a mirror note", bounded.SMALL_FILE_LIMIT)["url"])
    except (OSError, KeyError, TypeError, CheckpointError):
        return None


def fetch(folder: Path, url: str, storage_options: dict[str, Any] | None = None, rank: int | None = None,
          world_size: int | None = None, only: str | None = None) -> None:
    """Download a share (per rank of the node) of the files mirrored ``folder`` lacks; ``only``: below that folder."""
    folder = Path(folder)
    rank = int(os.environ.get("LOCAL_RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if world_size is None else world_size
    store = ObjectStore(url, storage_options)
    if not (folder / layout.MANIFEST_FILE).is_file():
        wrap(f"fetching '{store.url_of(folder.name)}'",
             lambda: store.download(folder.name, [layout.MANIFEST_FILE], folder))
    listed = (manifest.read_manifest(folder) or {}).get("files", {})
    refs = wrap(f"fetching '{store.url_of(folder.name)}'", lambda: pieces.read_record(store, folder.name, listed))
    share = []
    for i, (rel, entry) in enumerate(sorted(listed.items())):
        path = folder / rel
        if only is not None and not rel.startswith(only.rstrip("/") + "/"):
            continue
        if i % world_size == rank and not (path.is_file() and path.stat().st_size == int(entry["size"])):
            share.append(rel)
    sizes = {rel: int(listed[rel]["size"]) for rel in share}
    keys: dict[str, str] = {}  # the files of the share stored as pieces: where each is
    if share:
        remote = wrap(f"listing '{store.url_of(folder.name)}'", lambda: store.sizes(folder.name))
        keys, piece_sizes = wrap(f"listing '{store.url}/{layout.PIECES_DIR}'",
                                 lambda: pieces.sources(store, folder.name, refs, share))
        sizes = check_fetch(folder, store.url_of(folder.name), sizes, {**remote, **piece_sizes})
        share = list(sizes)
    wrap(f"fetching '{store.url_of(folder.name)}'",
         lambda: store.download(folder.name, share, folder, sizes, sources=keys))


def check_fetch(folder: Path, url: str, sizes: dict[str, int], remote: dict[str, int]) -> dict[str, int]:
    """The bytes to fetch of each file, checked before any download: one listed longer than its manifest size, or
    a total over the mirror's free space, is refused (one the listing lacks or shortens is left to the checks)."""
    fetched = {}
    for rel, size in sizes.items():
        if rel not in remote:
            continue
        if remote[rel] > size:
            raise CheckpointError(f"'{url}/{rel}': {layout.MANIFEST_FILE} gives {size} bytes, {remote[rel]} bytes "
                                  "in the listing; the checkpoint is damaged, nothing was downloaded")
        fetched[rel] = remote[rel]
    need = sum(fetched.values())
    probe = next((p for p in (folder, *folder.parents) if p.exists()), Path("."))
    free = shutil.disk_usage(probe).free
    if need > free:
        raise CheckpointError(f"'{url}' needs {human_size(need)} in the mirror '{folder.parent}', which has "
                              f"{human_size(free)} free; nothing was downloaded")
    return fetched


def open_run(url: str, storage_options: dict[str, Any] | None, mirror: Path) -> RemoteRun:
    return RemoteRun(ObjectStore(normalize(url), storage_options), mirror)
