"""Moving a damaged checkpoint aside: ``quarantine/<name>`` with a note saying why; the pointers follow."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

from automodel_ckpt.ondisk import catalog, layout, paths
from automodel_ckpt.ondisk.catalog import Monitor
from automodel_ckpt.ondisk.durable import fsync_dir, remove_pointer, set_pointer, write_atomic
from automodel_ckpt.ondisk.metadata import read_metadata
from automodel_ckpt.errors import CheckpointError


def quarantine(checkpoint_dir: Path, name: str, reason: str, *, monitor: str = "val_loss",
               best_metric_key: str | None = None, mode: str = "min") -> Path:
    """Rank 0: move checkpoint ``name`` to ``quarantine/`` with a note saying why, and point LATEST and
    LOWEST_VAL at the newest and best left (or remove them); returns its new path."""
    checkpoint_dir = Path(checkpoint_dir)
    folder = _own_folder(checkpoint_dir / layout.QUARANTINE_DIR)
    target = folder / name
    n = 1
    while os.path.lexists(target):  # the same step damaged twice (a rerun wrote it again): keep both
        n += 1
        target = folder / f"{name}.{n}"
    meta = read_metadata(checkpoint_dir / name) or {}
    (checkpoint_dir / name).rename(target)
    note = {"name": name, "step": meta.get("step"), "reason": reason, "quarantined_at": time.time()}
    write_atomic(folder / layout.quarantine_note(target.name), (json.dumps(note, indent=2) + "\n").encode("utf-8"))
    fsync_dir(folder)
    fsync_dir(checkpoint_dir)
    _repoint(checkpoint_dir, name, Monitor(monitor, best_metric_key, mode))
    return target


def _own_folder(folder: Path) -> Path:
    """``folder``, created if missing; anything but a real folder in its place (a symlink) is refused."""
    try:
        folder.mkdir()
    except FileExistsError:
        mode = os.lstat(folder).st_mode
        if not stat.S_ISDIR(mode):
            raise CheckpointError(f"'{folder}' is {paths.file_kind(mode)}, not a folder; damaged checkpoints are moved "
                                  "only into a real folder there: remove it") from None
    return folder


def _repoint(checkpoint_dir: Path, gone: str, monitor: Monitor) -> None:
    remaining = catalog.scan_checkpoints(checkpoint_dir)
    pointers = catalog.pointer_targets(checkpoint_dir)
    named = layout.best_pointer(monitor.name)  # LOWEST_VAL, or BEST_EVAL for an eval score
    for pointer, now in ((layout.LATEST, remaining[-1] if remaining else None), (named, monitor.best(remaining))):
        if pointers.get(pointer) != gone:
            continue
        if now is not None:
            set_pointer(checkpoint_dir, pointer, now.name)
        else:
            remove_pointer(checkpoint_dir, pointer)
