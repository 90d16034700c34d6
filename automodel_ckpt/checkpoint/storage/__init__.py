"""Where a run folder lives: a local folder or an object-store run folder, behind one interface chosen once.

``open_run_folder`` returns the ``RunFolder`` (``base``) for a ``checkpoint:`` section: ``LocalRunFolder`` (``local``)
or ``ObjectStoreRunFolder`` (``remote``). A new kind of storage is one more class here and one more line below.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from automodel_ckpt.checkpoint import objectstore
from automodel_ckpt.checkpoint.disk.catalog import Monitor
from automodel_ckpt.checkpoint.storage.local import LocalRunFolder
from automodel_ckpt.checkpoint.storage.remote import ObjectStoreRunFolder

if TYPE_CHECKING:
    from automodel_ckpt.checkpoint.config import CheckpointConfig
    from automodel_ckpt.checkpoint.storage.base import RunFolder

__all__ = ["LocalRunFolder", "ObjectStoreRunFolder", "monitor_of", "open_run_folder"]


def monitor_of(cfg: CheckpointConfig) -> Monitor:
    """The ``checkpoint:`` section's "best by monitor" (``monitor``, ``best_metric_key``, ``mode``)."""
    return Monitor(cfg.monitor, cfg.best_metric_key, str(cfg.mode))


def open_run_folder(cfg: CheckpointConfig, rank: int, world_size: int) -> RunFolder:
    """The run folder ``checkpoint.checkpoint_dir`` names (nothing is created or taken yet: ``acquire``)."""
    remote = objectstore.attach(cfg)
    if remote is not None:
        return ObjectStoreRunFolder(remote, rank, world_size, monitor=monitor_of(cfg),
                                    storage_options=cfg.storage_options)
    return LocalRunFolder(objectstore.run_folder(cfg), rank, monitor=monitor_of(cfg),
                          storage_options=cfg.storage_options)
