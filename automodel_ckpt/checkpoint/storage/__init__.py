"""Where run folders live, and the one way in for the recipe and every verb: a local folder or an object store.

A new kind of storage is a class and a line in ``open_run_folder``; ``objectstore/`` is this package's own.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from automodel_ckpt.checkpoint import objectstore
from automodel_ckpt.ondisk.catalog import Monitor
from automodel_ckpt.checkpoint.objectstore import (check_url, is_url, open_for_reading, run_folder, source_of,
                                                    stored_files, stored_sharing, streamed_object, upload_folder)
from automodel_ckpt.checkpoint.objectstore.location import mirror_folder, normalize, open_filesystem
from automodel_ckpt.checkpoint.objectstore.store import wrap
from automodel_ckpt.checkpoint.storage.local import LocalRunFolder
from automodel_ckpt.checkpoint.storage.remote import ObjectStoreRunFolder

if TYPE_CHECKING:
    from automodel_ckpt.checkpoint.objectstore.run import RemoteRun
    from automodel_ckpt.checkpoint.storage.base import RunStorage

__all__ = ["LocalRunFolder", "ObjectStoreRunFolder", "fetch_run_file", "is_url", "monitor_of", "open_filesystem",
           "open_for_reading", "open_run_folder", "open_store_run", "run_folder", "share_run_file", "source_of",
           "stored_files", "stored_sharing", "streamed_object", "upload_folder"]


def monitor_of(cfg: Any) -> Monitor:
    """A ``CheckpointConfig``'s "best by monitor" (``monitor``, ``best_metric_key``, ``mode``)."""
    return Monitor(cfg.monitor, cfg.best_metric_key, str(cfg.mode))


def open_run_folder(cfg: Any, rank: int, world_size: int) -> RunStorage:
    """The run folder ``checkpoint.checkpoint_dir`` names (nothing is created or taken yet: ``acquire``)."""
    remote = objectstore.attach(cfg)
    if remote is not None:
        return ObjectStoreRunFolder(remote, rank, world_size, monitor=monitor_of(cfg),
                                    storage_options=cfg.storage_options)
    return LocalRunFolder(objectstore.run_folder(cfg), rank, monitor=monitor_of(cfg),
                          storage_options=cfg.storage_options)


def share_run_file(cfg: Any, path: Path) -> None:
    """After writing ``path``, a run-folder file outside any checkpoint: an object store gets it from the mirror."""
    remote = objectstore.attach(cfg)
    if remote is not None:
        rel = Path(path).relative_to(run_folder(cfg)).as_posix()
        wrap(f"uploading '{remote.store.url_of(rel)}'", lambda: remote.store.upload(run_folder(cfg), [rel], ""))


def fetch_run_file(cfg: Any, path: Path) -> bool:
    """Whether run-folder file ``path`` is here, fetched into the mirror where the store holds it."""
    remote = objectstore.attach(cfg)
    if remote is not None and not Path(path).is_file():
        rel = Path(path).relative_to(run_folder(cfg)).as_posix()
        if wrap(f"checking '{remote.store.url_of(rel)}'", lambda: remote.store.exists(rel)):
            wrap(f"fetching '{remote.store.url_of(rel)}'", lambda: remote.store.download("", [rel], run_folder(cfg)))
    return Path(path).is_file()


def open_store_run(location: str, key: str) -> RemoteRun:
    """An object-store run folder to maintain (``ckpt-train gc``), checked; one line naming what is wrong."""
    from automodel_ckpt.ondisk import layout
    from automodel_ckpt.checkpoint.objectstore.run import open_run
    from automodel_ckpt.errors import UserError

    check_url(location, key)
    url = normalize(location)
    run = open_run(url, None, mirror_folder(url, None, role="read"))
    problem = run.store.access_problem(key, write=False)
    if problem:
        raise UserError(problem)
    if not run.store.exists(layout.RUN_MARKER):
        raise UserError(f"{key}: '{url}' is not a run folder (it holds no {layout.RUN_MARKER}, which every "
                        "ckpt-train run writes at its start); give the checkpoint.checkpoint_dir of one run")
    return run
