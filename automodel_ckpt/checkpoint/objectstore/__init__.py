"""Checkpoints on object storage (``checkpoint_dir: s3://bucket/run``): what ``storage/`` calls, and nothing else.

A local ``checkpoint_dir`` never comes here. See ``run`` for the commit protocol and docs/object-storage.md.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from automodel_ckpt.ondisk import layout, manifest, paths
from automodel_ckpt.checkpoint.locations import check_url, is_url, local_path, normalize
from automodel_ckpt.checkpoint.objectstore.location import mirror_folder
from automodel_ckpt.checkpoint.objectstore.run import RemoteRun, fetch, open_run, pulled_from, source_of
from automodel_ckpt.checkpoint.objectstore.store import ObjectStore, wrap
from automodel_ckpt.errors import CheckpointError, UserError, first_line

logger = logging.getLogger(__name__)

PART_SIZE = 32 * 2**20  # bytes of one part of a streamed upload (S3: at least 5 MiB, at most 10,000 parts)
_MAX_PARTS = 9000

__all__ = ["attach", "check_url", "fetch", "fetch_collectively", "fetch_object", "is_url", "localize",
           "open_for_reading", "run_folder", "source_of", "streamed_object", "stored_files", "stored_sharing",
           "upload_folder"]


def attach(cfg: Any) -> RemoteRun | None:
    """The object-store run folder of a ``CheckpointConfig`` (None for a local ``checkpoint_dir``)."""
    if not is_url(cfg.checkpoint_dir):
        return None
    url = normalize(str(cfg.checkpoint_dir))
    return open_run(url, cfg.storage_options, mirror_folder(url, cfg.staging_dir))


def run_folder(cfg: Any) -> Path:
    """The local folder a run writes its checkpoints and logs to: ``checkpoint_dir``, or its mirror for a URL."""
    if is_url(cfg.checkpoint_dir):
        return mirror_folder(str(cfg.checkpoint_dir), cfg.staging_dir)
    return local_path(str(cfg.checkpoint_dir))


def stored_files(folder: Path) -> dict[str, int]:
    """``{file: size}`` of a mirrored checkpoint as stored (its manifest), whatever the mirror holds of it."""
    try:
        listed = (manifest.read_manifest(folder) or {}).get("files", {})
    except CheckpointError:  # malformed or naming unsafe paths: nothing is known of it (`verify` says what)
        return {}
    return {rel: int(e["size"]) for rel, e in listed.items()}


def stored_sharing(run_mirror: Path, names: list[str]) -> tuple[dict[str, tuple[int, int]], int] | None:
    """``({checkpoint: (own bytes, shared bytes)}, bytes stored)`` of ``names`` in a mirror this process pulled
    whose checkpoints store pieces; None otherwise (a local folder, no pieces, an unreadable record)."""
    from automodel_ckpt.checkpoint.objectstore import pieces

    url = pulled_from(Path(run_mirror) / names[0]) if names else None
    if url is None:
        return None
    store = ObjectStore(url)
    try:
        records = wrap(f"reading '{url}'", lambda: pieces.records(store, names))
    except CheckpointError as exc:
        logger.warning("%s", exc)
        return None
    if not records:
        return None
    return pieces.sharing({n: stored_files(Path(run_mirror) / n) for n in names}, records)


def localize(target: str | None, storage_options: dict[str, Any] | None) -> str | None:
    """Rank 0: a ``restore_from`` URL as the local mirror folder of that checkpoint (catalog files only)."""
    if target is None or not is_url(target):
        return target
    return str(open_for_reading(target, storage_options, key="checkpoint.restore_from"))


def fetch_collectively(path: Path, storage_options: dict[str, Any] | None, rank: int) -> None:
    """Every rank: download mirrored checkpoint ``path`` (each rank of a node a share); a local one is left alone."""
    from automodel_ckpt.distributed import collective

    url = collective.on_main(lambda: pulled_from(path), "finding the checkpoint's store", rank)
    if url is not None:
        collective.collectively(lambda: fetch(path, url, storage_options), f"fetching '{url}/{path.name}'", rank)


def open_for_reading(location: str | Path, storage_options: dict[str, Any] | None = None, *,
                     fetch_all: bool = False, only: str | None = None, key: str = "path") -> Path:
    """A local folder to read ``location`` from: itself, or a URL's mirror (``fetch_all``: with every file)."""
    if not is_url(location):
        return local_path(str(location))
    location = str(location)
    check_url(location, key)
    url = normalize(location)
    if url.endswith(layout.ARCHIVE_SUFFIX):  # one object, ``ckpt-train pack``'s: read in place once downloaded
        return fetch_object(url, storage_options, key)
    store = ObjectStore(url, storage_options)
    problem = store.access_problem(key, write=False)
    if problem:
        raise UserError(problem)
    run_url, _, last = url.rpartition("/")
    if last in layout.POINTERS:  # s3://bucket/run/LATEST: the checkpoint the pointer names
        target = (ObjectStore(run_url, storage_options).read_text(last) or "").strip()
        if not target:
            raise UserError(f"{key}: '{url}' does not exist (no {last} pointer in '{run_url}')")
        if not paths.is_plain_name(target):
            raise CheckpointError(f"{key}: the {last} pointer in '{run_url}' names {target!r}, which is not a "
                                  "checkpoint name (one plain path component); name a checkpoint instead")
        url = f"{run_url}/{target}"
        store = ObjectStore(url, storage_options)
    one = wrap(f"reading '{url}'", lambda: store.exists(layout.MANIFEST_FILE))
    run_url = url.rsplit("/", 1)[0] if one else url
    run = open_run(run_url, storage_options, _fresh_folder() if fetch_all else mirror_folder(run_url, None, "read"))
    names = run.pull()
    if one:
        name = url.rsplit("/", 1)[1]
        if name not in names:
            raise UserError(f"{key}: '{url}' is not a committed checkpoint")
        targets = [run.mirror / name]
    else:
        if not names and not run.store.prefixes():
            raise UserError(f"{key}: nothing at '{url}' (no checkpoints, no pointers)")
        targets = [run.mirror / n for n in names]
    if fetch_all:
        for folder in targets:
            fetch(folder, run.url, storage_options, 0, 1, only=only)
    return targets[0] if one else run.mirror


def fetch_object(url: str, storage_options: dict[str, Any] | None, key: str) -> Path:
    """One object (an archive) downloaded whole into a fresh folder, ranges in parallel; its local path."""
    import shutil

    from automodel_ckpt.sizes import human_size

    parent, _, name = url.rpartition("/")
    store = ObjectStore(parent, storage_options)
    try:
        size = int(wrap(f"reading '{url}'", lambda: store.fs.info(store.key(name)))["size"])
    except (CheckpointError, FileNotFoundError) as exc:
        raise UserError(f"{key}: '{url}' does not exist or cannot be read ({exc})") from None
    folder = _fresh_folder()
    free = shutil.disk_usage(folder).free
    if size > free:
        raise CheckpointError(f"{key}: '{url}' is {human_size(size)}, but only {human_size(free)} are free in "
                              f"'{folder}' to download it; free space there or set TMPDIR")
    wrap(f"downloading '{url}'", lambda: store.download("", [name], folder, {name: size}))
    return folder / name


@contextlib.contextmanager
def streamed_object(url: str, size: int, *, key: str, storage_options: dict[str, Any] | None = None) -> Iterator[Any]:
    """A file whose bytes go to the object ``url`` as written, in multipart parts of ``PART_SIZE`` (or more); the
    object appears when the block ends without an error, else the upload is aborted."""
    check_url(url, key)
    parent, _, name = normalize(url).rpartition("/")
    store = ObjectStore(parent, storage_options)
    what = f"uploading to '{url}'"
    part_size = max(PART_SIZE, -(-size // _MAX_PARTS))
    file = wrap(what, lambda: store.fs.open(store.key(name), "wb", block_size=part_size))
    try:
        yield _Upload(file, what, part_size)
        wrap(what, file.close)  # the commit
    except BaseException:
        _abort(file)
        raise


@dataclass
class _Upload:
    """What ``streamed_object`` hands out: ``write`` only, its failures in one line."""

    file: Any
    what: str
    part_size: int

    def write(self, data: bytes | memoryview) -> None:
        wrap(self.what, lambda: self.file.write(data))


def _abort(file: Any) -> None:
    """Abort an upload never committing it: never ``close`` it, and mark it closed so that GC does not either."""
    try:
        file.discard()
    except Exception as exc:  # noqa: BLE001 - the error that got us here is the one to report
        logger.warning("could not abort the upload of '%s' (%s); the store removes incomplete uploads by its "
                       "lifecycle rules", getattr(file, "path", "?"), first_line(exc))
    from fsspec.spec import AbstractBufferedFile

    if isinstance(file, AbstractBufferedFile):
        file.closed = True


def _fresh_folder() -> Path:
    """An empty folder, removed when the process exits: what is checked or exported is what the store holds now."""
    import atexit
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="automodel-ckpt-object-store-"))
    atexit.register(shutil.rmtree, folder, True)
    return folder


def upload_folder(folder: Path, url: str, storage_options: dict[str, Any] | None = None,
                  last: tuple[str, ...] = ()) -> None:
    """Upload ``folder`` to ``url``, the ``last`` names after all others (a config never without its weights)."""
    from automodel_ckpt.ondisk.manifest import list_files

    check_url(url, "--out")
    store = ObjectStore(normalize(url), storage_options)
    rels = list(list_files(folder))
    first = [r for r in rels if r not in last]
    wrap(f"uploading to '{store.url}'", lambda: store.upload(folder, first, ""))
    wrap(f"uploading to '{store.url}'", lambda: store.upload(folder, [r for r in rels if r in last], ""))
