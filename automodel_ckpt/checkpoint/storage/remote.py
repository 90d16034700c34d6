"""An object-store run folder (``checkpoint_dir: s3://bucket/run``): the local mirror's steps plus the store's.

Saves go into the mirror as into a local folder (``LocalRunFolder``, extended here); each rank uploads its share,
rank 0 commits (``objectstore.run``). The run holds the mirror's ``flock`` and the bucket's lease.
"""

from __future__ import annotations

import logging
from pathlib import Path

from automodel_ckpt.distributed import collective
from automodel_ckpt.ondisk import layout
from automodel_ckpt.ondisk.retention import RetentionPolicy
from automodel_ckpt.checkpoint.objectstore.run import RemoteRun
from automodel_ckpt.checkpoint.storage.local import LocalRunFolder

logger = logging.getLogger(__name__)


class ObjectStoreRunFolder(LocalRunFolder):
    """``storage.base.RunStorage`` for a run folder on an object store, worked through its local mirror."""

    reserves_in_background = False  # the store is checked (and its upload marker written) before the copy

    def __init__(self, remote: RemoteRun, rank: int, world_size: int, **kwargs: object) -> None:
        super().__init__(remote.mirror, rank, **kwargs)  # type: ignore[arg-type]
        self.remote = remote
        self.world_size = world_size
        self._refs: dict[str, dict[str, tuple[str, bool]]] = {}  # rank 0: each save's files stored as pieces

    def location(self, name: str) -> str:
        return self.remote.store.url_of(name)

    def acquire(self) -> None:
        super().acquire()  # endpoint, bucket and credentials: one line each, before training; then the lease
        collective.on_main(self.remote.prepare, f"opening {self.remote.url}", self.rank)

    def release(self, *, keep_lock: bool = False) -> None:
        if not keep_lock and self.rank == 0:  # a finished run: the logs' records since the last commit (its save's)
            try:
                self.remote.push_logs()
            except Exception as e:  # noqa: BLE001 - the checkpoints are committed; only the logs' tail is missing
                logger.warning("the logs' last records were not uploaded to %s: %s", self.remote.url, e)
        self.remote.release()  # the run folder's lease (rank 0): the next run need not wait for it to expire
        super().release(keep_lock=keep_lock)

    def _reserve_here(self, name: str) -> Path:
        removed = self.remote.before_save(name)  # an existing checkpoint refused; unfinished uploads deleted
        if removed:
            logger.info("removed unfinished uploads from %s: %s", self.remote.url, ", ".join(removed))
        return super()._reserve_here(name)

    def upload(self, staging: Path, name: str) -> bool:
        shares = collective.gathered(lambda: self.remote.upload_share(staging, name, self.rank, self.world_size),
                                     f"uploading '{self.remote.store.url_of(name)}'", self.rank)
        if self.rank == 0:  # a few files per rank: what the reference record lists
            self._refs = {name: {rel: ref for share in shares for rel, ref in share.items()}}
        return True

    def _publish(self, name: str, best: bool) -> Path:
        """Rank 0, after every rank's uploads: the commit object, the mirror's publish, then the pointer objects."""
        self.remote.upload_commit_object(self.staging(name), name, self._refs.pop(name, None))
        final = super()._publish(name, best)
        self.remote.after_publish(final)
        return final

    def _prune_on_main(self, policy: RetentionPolicy, resumed_from: str | None) -> list[str]:
        deleted = self._prune_here(policy, [resumed_from] if resumed_from else [])  # its files left the mirror
        self.remote.delete(deleted)
        return deleted

    def quarantine(self, name: str, reason: str) -> str:
        moved = self._quarantine_here(name, reason)
        self.remote.quarantine(name, reason)  # a note object, and the pointers re-set
        return f"{self.remote.url}/{layout.QUARANTINE_DIR}/ (and {moved})"
