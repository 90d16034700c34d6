"""What the durable tier decides (``Decision``) and what it needs of the run folder to decide it (``Source``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


@dataclass(frozen=True)
class Decision:
    """What a run resumes from: ``path`` None, a fresh run; otherwise a checkpoint of the run's own, already checked
    on every rank, that the loader loads (``restore.loader.CheckpointLoader.load``)."""

    path: Path | None = None
    fallback: bool = False  # found damaged while loading: set it aside and decide again (an automatic resume)

    @property
    def fresh(self) -> bool:
        return self.path is None


class Source(Protocol):
    """The run folder as restore sees it. ``find``, ``has_checkpoints`` and ``fetch`` are collective (all ranks call
    them, rank 0 decides, a failure anywhere raises the same ``CheckpointError`` on every rank); ``quarantine`` runs
    on rank 0. ``storage.RunFolder`` implements it."""

    local: Path  # the local folder whose checkpoints are listed (``checkpoint_dir``, or an object store's mirror)

    def find(self, restore_from: str | None, what: str = "finding the checkpoint") -> Path | None:
        """The checkpoint ``restore_from`` names (None: the latest, or None when there is none)."""

    def has_checkpoints(self) -> bool:
        """Whether the run folder holds a checkpoint of its own."""

    def fetch(self, path: Path) -> None:
        """Bring checkpoint ``path``'s files to local disk (an object store's; a local one is left alone)."""

    def quarantine(self, name: str, reason: str) -> str:
        """Rank 0: move damaged checkpoint ``name`` aside and repoint the pointers; returns where it went, as words."""
