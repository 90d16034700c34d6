"""Checkpoint lifecycle across ranks: reserve a staging folder, publish it, prune old checkpoints.

Every rank writes into ``.staging-<name>``; once fsynced and agreed, rank 0 renames it into place and swaps the
pointers (``collective``: a failure on any rank raises the same error on every rank instead of hanging).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Iterable

from automodel_ckpt.ondisk import catalog, layout
from automodel_ckpt.ondisk.retention import RetentionPolicy, to_delete
from automodel_ckpt.ondisk.durable import fsync_dir, remove_tree, set_pointer
from automodel_ckpt.errors import CheckpointError


def reserve(checkpoint_dir: Path, name: str) -> Path:
    """Rank 0: create ``.staging-<name>`` after removing leftovers of interrupted saves. Never overwrites."""
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    final = checkpoint_dir / name
    if os.path.lexists(final):
        raise CheckpointError(
            f"checkpoint '{final}' already exists and is never overwritten; "
            "restore from the newest checkpoint or use another checkpoint.checkpoint_dir"
        )
    discard_staging(checkpoint_dir)
    staging = checkpoint_dir / layout.staging_name(name)
    staging.mkdir()
    fsync_dir(checkpoint_dir)
    return staging


def discard_staging(checkpoint_dir: Path) -> list[str]:
    """Rank 0: remove the ``.staging-*`` folders of unfinished saves, following no link; their names."""
    removed = []
    for leftover in Path(checkpoint_dir).iterdir():
        if layout.is_staging(leftover.name):
            remove_tree(leftover)
            removed.append(leftover.name)
    return removed


def publish(checkpoint_dir: Path, name: str, *, update_lowest_val: bool, best: str = layout.LOWEST_VAL) -> Path:
    """Rank 0: rename the staged checkpoint into place, then point LATEST (and the ``best`` pointer) at it."""
    staging = checkpoint_dir / layout.staging_name(name)
    final = checkpoint_dir / name
    staging.rename(final)
    fsync_dir(checkpoint_dir)
    set_pointer(checkpoint_dir, layout.LATEST, name)
    if update_lowest_val:
        set_pointer(checkpoint_dir, best, name)
    return final


def prune(checkpoint_dir: Path, policy: RetentionPolicy, monitor: str, best_metric_key: str | None = None,
          protected: Iterable[str] = ()) -> list[str]:
    """Rank 0, after publish: delete what the policy gives up, never a pointer's target, ``protected`` or the
    newest, nor a staging folder. Each is hidden by a rename first (a crash never leaves a half-deleted one that
    looks complete); a failure is a warning."""
    checkpoint_dir = Path(checkpoint_dir)
    for leftover in checkpoint_dir.iterdir():
        if leftover.name.startswith(layout.DELETING_PREFIX):
            remove_tree(leftover)  # a symlink of that name is removed itself, never followed
    if not policy.prunes:
        return []
    protected = {t for t in catalog.pointer_targets(checkpoint_dir).values() if t} | set(protected)
    records = catalog.candidates(catalog.scan_checkpoints(checkpoint_dir), monitor, best_metric_key)
    deleted = []
    for name in to_delete(records, policy, protected):
        hidden = checkpoint_dir / layout.deleting_name(name)
        try:
            (checkpoint_dir / name).rename(hidden)
        except OSError as exc:
            warnings.warn(f"checkpoint retention could not delete '{checkpoint_dir / name}': {exc}", stacklevel=2)
            continue
        fsync_dir(checkpoint_dir)
        remove_tree(hidden)  # what remains of it is removed by the next prune
        deleted.append(name)
    return deleted
