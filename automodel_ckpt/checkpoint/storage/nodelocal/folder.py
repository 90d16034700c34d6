"""The node-local tier as a kind of run folder: each node writes its own folder, copies go to other nodes' folders.

Unshared folders: ``upload`` sends each node's parts to their keepers, ``commit`` renames on every node; nothing is
fsynced (a RAM disk dies with its node; the copies elsewhere are what survives).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from automodel_ckpt.distributed import collective
from automodel_ckpt.ondisk import layout
from automodel_ckpt.ondisk.catalog import Monitor
from automodel_ckpt.ondisk.durable import remove_tree
from automodel_ckpt.ondisk.retention import RetentionPolicy
from automodel_ckpt.checkpoint.storage import lifecycle
from automodel_ckpt.checkpoint.storage.local import LocalRunFolder
from automodel_ckpt.checkpoint.storage.nodelocal import abandon, localdir, replicate
from automodel_ckpt.checkpoint.storage.nodelocal.inventory import folder_id
from automodel_ckpt.checkpoint.storage.nodelocal.placement import Placement
from automodel_ckpt.distributed.env import all_gather_object
from automodel_ckpt.errors import CheckpointError, first_line


class NodeLocalRunFolder(LocalRunFolder):
    """``storage.base.RunStorage`` for one node's folder of the node-local tier (see the module docstring)."""

    reserves_in_background = True
    shared = False
    durable = False

    def __init__(self, folder: Path, placement: Placement, *, run_id: str, fingerprint: Any, monitor: Monitor,
                 default_folder: bool, say: Any = print) -> None:
        super().__init__(folder, placement.rank, monitor=monitor)
        self.placement, self.run_id, self.fingerprint = placement, run_id, fingerprint
        self.default_folder = default_folder  # under /dev/shm/automodel-ckpt-<user>/: that parent is made private
        self.say = say
        self.folder_ids: list[str] = []  # by rank: which folder each rank writes (ranks sharing one agree)

    @property
    def leads(self) -> bool:
        """Whether this rank acts for its folder (the lowest rank writing to it)."""
        mine = self.folder_ids[self.rank]
        return self.folder_ids.index(mine) == self.rank

    def location(self, name: str) -> str:
        return f"{self.local / name} (node-local)"

    def acquire(self) -> None:
        """Collective: every node's folder made private and bound to this run, then which ranks share which folder."""
        first_on_node = self.rank % self.placement.ranks_per_node == 0
        notes = collective.collectively(self._claim if first_on_node else list, f"preparing '{self.local}'", self.rank)
        for note in notes:
            self.say(f"warning: {note}")
        self.folder_ids = all_gather_object(folder_id(self.local))

    def _claim(self) -> list[str]:
        return localdir.claim(self.local, self.run_id, self.fingerprint, private_parent=self.default_folder)

    def release(self, *, keep_lock: bool = False) -> None:
        """A finished run (``keep_lock`` False) removes its node-local steps; a failed one keeps them."""
        if keep_lock or not self.folder_ids or not self.leads:
            return
        for pointer in layout.POINTERS:
            if os.path.islink(self.local / pointer):
                os.unlink(self.local / pointer)
        for entry in list(self.local.iterdir()) if self.local.is_dir() else []:
            if entry.name.startswith(layout.DELETING_PREFIX) or layout.is_staging(entry.name):
                remove_tree(entry)
        localdir.remove(self.local, self.run_id)

    def reserve(self, name: str) -> Path:
        collective.collectively(lambda: self._reserve_here(name) if self.leads else None,
                                "reserving the node-local step", self.rank)
        return self.staging(name)

    def _reserve_here(self, name: str) -> Path:
        """A step of this name left from before the last resume is stale: the run has gone back past it."""
        if os.path.lexists(self.local / name):
            remove_tree(self.local / name)
        return lifecycle.reserve(self.local, name)

    def upload(self, staging: Path, name: str) -> bool:
        collective.collectively(lambda: replicate.copy_parts(staging, self.rank, self.folder_ids, self.placement),
                                f"copying '{name}' to other nodes", self.rank)
        return True

    def commit(self, staging: Path, name: str, *, best: bool) -> Path:
        """Every node renames its staging folder into place, once every node has checked it can (so a node's
        commit seldom goes through where another's fails; where it does, the step is abandoned: ``discard``)."""
        collective.collectively(lambda: self._can_publish(staging) if self.leads else None,
                                "checking the node-local folders before the commit", self.rank)
        collective.collectively(lambda: self._publish(name, best) if self.leads else None,
                                "publishing the node-local step", self.rank)
        return self.local / name

    def _can_publish(self, staging: Path) -> None:
        if not staging.is_dir():
            raise CheckpointError(f"'{staging}' is gone")
        if os.statvfs(self.local).f_flag & os.ST_RDONLY:
            raise CheckpointError(f"'{self.local}' is on a read-only filesystem")
        if not os.access(self.local, os.W_OK | os.X_OK):
            raise CheckpointError(f"'{self.local}' is not writable")

    def remake(self) -> list[str]:
        """Collective: each node's folder made again where it was removed; the folders remade, on every rank."""
        def here() -> str | None:
            if not self.leads or os.path.lexists(self.local):
                return None
            self._claim()
            return str(self.local)

        made = collective.collectively(here, f"making '{self.local}' again", self.rank)
        return [m for m in all_gather_object(made) if m]

    def discard(self, name: str) -> list[str]:
        """Collective, never failing: every node removes what it holds of abandoned ``name`` and unfinished steps, in
        ``abandon``'s two phases; the lines saying what could not be removed, on every rank."""
        lines: list[str] = []
        for phase in (lambda: abandon.hide(self.local, name), lambda: abandon.clear(self.local)):
            mine: list[str] = []
            if self.leads:
                try:
                    mine = phase()
                except Exception as exc:  # noqa: BLE001 - the other ranks wait in the gather below
                    mine = [f"cleaning '{self.local}' failed: {first_line(exc)}"]
            lines += [line for got in all_gather_object(mine) for line in got]
        return lines

    def prune(self, policy: RetentionPolicy, resumed_from: str | None) -> list[str]:
        deleted = collective.collectively(lambda: self._prune_here(policy) if self.leads else [],
                                          "removing old node-local steps", self.rank)
        return deleted if self.rank == 0 else []
