"""The one interface every experiment-tracking backend implements, and what opening one is told."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from automodel_ckpt.errors import ConfigError


@dataclass
class OpenContext:
    """What a backend needs to open (or reopen) the run's tracked run."""

    run_dir: Path  # the run folder (checkpoint.checkpoint_dir, or its local mirror)
    run_name: str  # the run folder's name: the tracked run's display name
    location: str  # where the backend writes: ``Backend.location``, from the recipe alone
    hparams: dict[str, Any]  # the resolved recipe, as written into each checkpoint's config.yaml
    saved: dict[str, Any] = field(default_factory=dict)  # the restored run id, only when saved for ``location``
    resume_step: int | None = None  # the restored step (None: a fresh start)
    confirmed_step: int = 0  # the last step the backend had made durable when the restored checkpoint was saved
    append: bool = False  # only add points to the existing tracked run (``annotate``): nothing made or purged


class Backend:
    """One tracker, called on rank 0's tracking thread in order; an exception disables it. ``open`` returns what
    reopens the run later. ``durable``: what a ``flush`` returned on survives a SIGKILL (else a resume replays the
    whole history); ``acknowledged``: a returned ``log_metrics`` is durable already, no ``flush`` needed."""

    name = ""
    module = ""  # the package that must be importable
    extra = ""  # the pip extra that installs it
    durable = True
    acknowledged = False  # True: a log call that returns has made its data durable (the store answered)
    legacy_location_key = ""  # the state key under which earlier versions saved the location
    appends = False  # ``open`` with ``ctx.append``: points added later to a tracked run at steps it already has

    def local_path(self, location: str) -> Path | None:
        """The file or folder ``location`` writes to; None for a server."""
        return Path(location)

    def __init__(self, section: Any) -> None:
        self.section = section  # the backend's `logging.<name>` config node

    def location(self, run_dir: Path, run_name: str) -> str:
        """Where this backend writes: from the recipe alone, never a checkpoint (which must not redirect the metrics
        nor the credentials). Default: the run folder."""
        return os.path.abspath(run_dir)

    def same_location(self, saved: Any, location: str) -> bool:
        """Whether ``saved`` (read from a checkpoint: any value) names ``location``."""
        return isinstance(saved, str) and saved == location

    def open(self, ctx: OpenContext) -> dict[str, Any]:
        """Open (or with ``ctx.saved``'s run id, reopen) the tracked run; the state that reopens it later."""
        raise NotImplementedError

    def initial_state(self, saved: dict[str, Any]) -> dict[str, Any]:
        """The state known before ``open`` (restored), which checkpoints record while it opens. Default: none."""
        return {}

    def first_replay_step(self, confirmed_step: int) -> int:
        """The first step to replay on resume, given the step ``flush`` had confirmed when the checkpoint was saved."""
        return confirmed_step + 1

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def log_event(self, kind: str, text: str, step: int) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """Make everything logged so far durable (as far as the backend can)."""

    def close(self, status: str) -> None:
        """End of this launch: ``status`` is ``complete``, ``preempted`` or ``failed``."""


def require_installed(backend: type[Backend]) -> None:
    """``ConfigError`` naming the extra when the backend's package is missing."""
    if importlib.util.find_spec(backend.module) is None:
        raise ConfigError(f"logging.{backend.name}: the '{backend.module}' package is not installed; "
                          f"pip install 'automodel-ckpt[{backend.extra}]' (or remove logging.{backend.name})")


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a.b": 1}`` from ``{"a": {"b": 1}}``; lists stay values."""
    if not isinstance(tree, dict):
        return {prefix: tree} if prefix else {}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            out.update(flatten(value, name))
        else:
            out[name] = value
    return out
