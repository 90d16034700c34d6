"""The one interface of a run folder: where checkpoints are staged, committed, listed, fetched, pruned and locked.

Checkpoints are always written and read through a local folder (``local``): the run folder itself, or the local
mirror of an object-store run folder. What differs between kinds of storage is what happens around that folder:
taking the folder (a ``flock``; on an object store a lease too), the step before a save writes (``reserve``), the
steps that make a save visible (``upload`` + ``commit``), deleting by retention, fetching a checkpoint's files
before it is loaded, and moving a damaged checkpoint aside. The ``Checkpointer`` picks one implementation when it
is built (``storage.open_run_folder``) and never asks which one it has; every method is a plain call (no
callbacks), so a kind is a class and nothing else.

The promises every kind keeps (``tests/unit/checkpoint/storage/test_contract.py`` holds each kind to them):
a checkpoint exists for readers only after ``commit`` returned; nothing that another program wrote is ever
deleted; the pointers follow a quarantine; ``prune`` keeps what the policy keeps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from automodel_ckpt.ondisk.catalog import Monitor
from automodel_ckpt.ondisk.retention import RetentionPolicy


class RunFolder(Protocol):
    """A run folder (see the module docstring). Methods marked "rank 0" run there only; the rest are collective."""

    local: Path
    monitor: Monitor  # "best by monitor": which checkpoint LOWEST_VAL names
    reserves_in_background: bool  # the staging folder may be made by the background thread of an async save
    shared: bool  # every rank sees the same folder (False: each node has its own, ``nodelocal``)
    durable: bool  # a commit is fsynced first (False: a RAM disk's tier, gone with the node anyway)

    def location(self, name: str) -> str:
        """Checkpoint ``name`` of this run folder as the user configured it: a path, or a URL (what a save
        announces). ``location_of`` says the same of a local folder."""

    def location_of(self, path: Path) -> str:
        """A local checkpoint folder as the user knows it: its path, or the URL its mirror copies (what a load
        announces; the folder may belong to another run, a ``restore_from``). ``location`` takes a name."""

    def acquire(self) -> None:
        """Collective, before training: check the folder can be written and take it for this run."""

    def release(self, *, keep_lock: bool = False) -> None:
        """End of the run: give up the lease, and the folder's lock unless ``keep_lock`` (a failed run)."""

    def staging(self, name: str) -> Path:
        """Where checkpoint ``name`` is written before its commit (nothing is created: ``reserve``)."""

    def reserve(self, name: str) -> Path:
        """Collective: create the staging folder of checkpoint ``name`` (never an existing checkpoint's); returns
        it. Leftovers of interrupted saves are removed first."""

    def upload(self, staging: Path, name: str) -> bool:
        """Collective: this rank's share of the staged files to where they are kept; False when that is here."""

    def best(self) -> Path | None:
        """The checkpoint that is best by ``monitor`` so far (what LOWEST_VAL names), or None."""

    def commit(self, staging: Path, name: str, *, best: bool) -> Path:
        """Collective: make the sealed checkpoint visible under ``name`` and point LATEST (and LOWEST_VAL when
        ``best``) at it; returns its local folder."""

    def prune(self, policy: RetentionPolicy, resumed_from: str | None) -> list[str]:
        """Collective: delete what the retention policy gives up (an object store keeps ``resumed_from``, whose files
        its mirror no longer holds); returns the names deleted."""

    def find(self, restore_from: str | None, what: str = "finding the checkpoint") -> Path | None:
        """Collective: the checkpoint ``restore_from`` names (None: the latest), as a local folder; ``what``
        names the step in an error."""

    def has_checkpoints(self) -> bool:
        """Collective: whether the run folder holds a checkpoint."""

    def fetch(self, path: Path) -> None:
        """Collective: checkpoint ``path``'s files onto local disk before it is checked and loaded."""

    def quarantine(self, name: str, reason: str) -> str:
        """Rank 0: move damaged checkpoint ``name`` aside (pointers follow); where it went, in words."""
