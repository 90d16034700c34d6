"""The one interface of a run folder: where checkpoints are staged, committed, listed, fetched, pruned and locked.

Checkpoints go through a local folder (the run folder, or an object store's mirror); a kind of storage is a class
of plain methods around it, picked once (``storage.open_run_folder``). Every kind keeps the promises
``tests/unit/checkpoint/storage/test_contract.py`` holds it to: a checkpoint exists for readers only after ``commit``,
nothing another program wrote is deleted, the pointers follow a quarantine, ``prune`` keeps what the policy keeps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from automodel_ckpt.ondisk.catalog import Monitor
from automodel_ckpt.ondisk.retention import RetentionPolicy


class RunStorage(Protocol):
    """A run folder (see the module docstring). Methods marked "rank 0" run there only; the rest are collective."""

    local: Path
    monitor: Monitor  # "best by monitor": which checkpoint LOWEST_VAL names
    reserves_in_background: bool  # the staging folder may be made by the background thread of an async save
    shared: bool  # every rank sees the same folder (False: each node has its own, ``nodelocal``)
    durable: bool  # a commit is fsynced first (False: a RAM disk's tier, gone with the node anyway)

    def location(self, name: str) -> str:
        """Checkpoint ``name`` as the user configured it, a path or a URL (what a save announces)."""

    def location_of(self, path: Path) -> str:
        """A local checkpoint folder as the user knows it, its path or its mirror's URL (what a load announces)."""

    def acquire(self) -> None:
        """Collective, before training: check the folder can be written and take it for this run."""

    def release(self, *, keep_lock: bool = False) -> None:
        """End of the run: give up the lease, and the folder's lock unless ``keep_lock`` (a failed run)."""

    def staging(self, name: str) -> Path:
        """Where checkpoint ``name`` is written before its commit (nothing is created: ``reserve``)."""

    def reserve(self, name: str) -> Path:
        """Collective: ``name``'s staging folder (never an existing checkpoint's), leftovers of saves removed first."""

    def upload(self, staging: Path, name: str) -> bool:
        """Collective: this rank's share of the staged files to where they are kept; False when that is here."""

    def best(self) -> Path | None:
        """The checkpoint that is best by ``monitor`` so far (what LOWEST_VAL names), or None."""

    def commit(self, staging: Path, name: str, *, best: bool) -> Path:
        """Collective: publish the sealed checkpoint ``name``, LATEST (and LOWEST_VAL when ``best``) on it."""

    def prune(self, policy: RetentionPolicy, resumed_from: str | None) -> list[str]:
        """Collective: delete what retention gives up (a store keeps ``resumed_from``); the names deleted."""

    def find(self, restore_from: str | None, what: str = "finding the checkpoint") -> Path | None:
        """Collective: the checkpoint ``restore_from`` names (None: the latest), as a local folder."""

    def has_checkpoints(self) -> bool:
        """Collective: whether the run folder holds a checkpoint."""

    def fetch(self, path: Path) -> None:
        """Collective: checkpoint ``path``'s files onto local disk before it is checked and loaded."""

    def quarantine(self, name: str, reason: str) -> str:
        """Rank 0: move damaged checkpoint ``name`` aside (pointers follow); where it went, in words."""
