"""A run folder on a local or mounted filesystem: ``checkpoint_dir`` itself, taken by a ``flock`` for the run."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from automodel_ckpt.distributed import collective
from automodel_ckpt.ondisk import catalog, layout
from automodel_ckpt.ondisk.catalog import Monitor
from automodel_ckpt.ondisk.durable import unwritable
from automodel_ckpt.ondisk.quarantine import quarantine
from automodel_ckpt.ondisk.retention import RetentionPolicy
from automodel_ckpt.checkpoint.objectstore import fetch_collectively, localize, source_of
from automodel_ckpt.checkpoint.storage import lifecycle
from automodel_ckpt.checkpoint.storage.runlock import RunLock, hold
from automodel_ckpt.errors import CheckpointError


class LocalRunFolder:
    """``storage.base.RunStorage`` for a folder on disk; also the local half of an object-store run folder."""

    reserves_in_background = True
    shared = True
    durable = True

    def __init__(self, folder: Path, rank: int, *, monitor: Monitor,
                 storage_options: dict[str, Any] | None = None) -> None:
        self.local = Path(folder)
        self.rank = rank
        self.monitor = monitor  # "best by monitor": what LOWEST_VAL names, after a commit or a quarantine
        self.storage_options = storage_options  # for a ``restore_from`` URL (another run folder on a store)
        self.lock = RunLock(self.local)  # held (by rank 0) from ``acquire`` to ``release``

    def location(self, name: str) -> str:
        return str(self.local / name)

    def location_of(self, path: Path) -> str:
        url = source_of(path)  # a checkpoint in an object store's mirror (this run's or a restore_from URL's)
        return f"{url}/{Path(path).name}" if url else str(path)

    def acquire(self) -> None:
        problem = collective.on_main(lambda: unwritable(self.local), "checking checkpoint.checkpoint_dir", self.rank)
        if problem:
            raise CheckpointError(problem)
        self.lock = hold(self.local, self.rank)  # one run per folder: before anything is written (runlock)

    def release(self, *, keep_lock: bool = False) -> None:
        if not keep_lock:
            self.lock.release()  # the next run may take the folder (a failed run keeps it until its process ends)

    def staging(self, name: str) -> Path:
        return self.local / layout.staging_name(name)

    def reserve(self, name: str) -> Path:
        return collective.on_main(lambda: self._reserve_here(name), "reserving the checkpoint", self.rank)

    def _reserve_here(self, name: str) -> Path:
        """Rank 0: the staging folder, after removing leftovers of interrupted saves."""
        return lifecycle.reserve(self.local, name)

    def upload(self, staging: Path, name: str) -> bool:
        return False

    def best(self) -> Path | None:
        return catalog.pointer_target(self.local, layout.best_pointer(self.monitor.name))

    def commit(self, staging: Path, name: str, *, best: bool) -> Path:
        return collective.on_main(lambda: self._publish(name, best), "publishing the checkpoint", self.rank)

    def _publish(self, name: str, best: bool) -> Path:
        """Rank 0: rename the staged checkpoint into place, then set the pointers."""
        return lifecycle.publish(self.local, name, update_lowest_val=best, best=layout.best_pointer(self.monitor.name))

    def prune(self, policy: RetentionPolicy, resumed_from: str | None) -> list[str]:
        return collective.on_main(lambda: self._prune_on_main(policy, resumed_from), "pruning old checkpoints",
                                  self.rank)

    def _prune_on_main(self, policy: RetentionPolicy, resumed_from: str | None) -> list[str]:
        return self._prune_here(policy)

    def _prune_here(self, policy: RetentionPolicy, protected: Iterable[str] = ()) -> list[str]:
        return lifecycle.prune(self.local, policy, self.monitor.name, self.monitor.key, protected=protected)

    def find(self, restore_from: str | None, what: str = "finding the checkpoint") -> Path | None:
        return collective.on_main(  # a restore_from URL: read from its mirror (``objectstore.localize``)
            lambda: catalog.resolve_restore_from(self.local, localize(restore_from, self.storage_options)), what,
            self.rank)

    def has_checkpoints(self) -> bool:
        return collective.on_main(lambda: catalog.latest_checkpoint(self.local) is not None, "listing checkpoints",
                                  self.rank)

    def fetch(self, path: Path) -> None:
        fetch_collectively(Path(path), self.storage_options, self.rank)

    def quarantine(self, name: str, reason: str) -> str:
        return str(self._quarantine_here(name, reason))

    def _quarantine_here(self, name: str, reason: str) -> Path:
        return quarantine(self.local, name, reason, monitor=self.monitor.name, best_metric_key=self.monitor.key,
                          mode=self.monitor.mode)
