"""The one interface of a run folder: where checkpoints are reserved, published, listed, fetched, pruned and locked.

Checkpoints are always written and read through a local folder (``local``): the run folder itself, or the local
mirror of an object-store run folder. What differs between kinds of storage is what happens around that folder:
taking the folder (a ``flock``; on an object store a lease too), the step before a save writes (``reserve``), the
steps that make a save visible (``upload`` + ``commit``), deleting by retention, fetching a checkpoint's files
before it is loaded, and moving a damaged checkpoint aside. The ``Checkpointer`` picks one implementation when it
is built (``storage.open_run_folder``) and never asks which one it has.

Invariant every implementation keeps: a checkpoint exists for readers only after ``commit`` returned; nothing that
another program wrote is ever deleted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Protocol

from automodel_ckpt.checkpoint.disk.catalog import Monitor
from automodel_ckpt.checkpoint.disk.retention import RetentionPolicy


class RunFolder(Protocol):
    """A run folder (see the module docstring). ``rank`` marks what runs on rank 0 only; the rest is collective."""

    local: Path
    reserves_in_background: bool  # the staging folder may be made by the background thread of an async save

    def location(self, name: str) -> str:
        """Checkpoint ``name`` as the user configured it: a path, or a URL."""

    def where(self, path: Path) -> str:
        """A local checkpoint folder as the user knows it: its path, or the URL its mirror copies."""

    def acquire(self) -> None:
        """Collective, before training: check the folder can be written and take it for this run."""

    def release(self, *, keep_lock: bool = False) -> None:
        """End of the run: give up the lease, and the folder's lock unless ``keep_lock`` (a failed run)."""

    def reserve(self, name: str) -> Path:
        """Rank 0: the staging folder of checkpoint ``name`` (never an existing checkpoint's)."""

    def upload(self, staging: Path, name: str) -> bool:
        """Collective: this rank's share of the staged files to where they are kept; False when that is here."""

    def commit(self, staging: Path, name: str, publish: Callable[[], Path]) -> Path:
        """Collective: make the checkpoint visible (``publish`` renames it in ``local`` and sets the pointers)."""

    def prune(self, policy: RetentionPolicy, monitor: Monitor, resumed_from: str | None) -> list[str]:
        """Rank 0: delete what the retention policy gives up (an object store keeps ``resumed_from``, whose files
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
