"""What the durable tier decides: ``Decision``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Decision:
    """What a run resumes from: ``path`` None, a fresh run; otherwise a checkpoint of the run's own, already checked
    on every rank, that the loader loads (``restore.loader.CheckpointLoader.load``)."""

    path: Path | None = None
    fallback: bool = False  # found damaged while loading: set it aside and decide again (an automatic resume)

    @property
    def fresh(self) -> bool:
        return self.path is None
