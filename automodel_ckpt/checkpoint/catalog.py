"""A checkpoint_dir read as records: what restore selection, retention and ``ckpt-train inspect`` look at.

A folder is a checkpoint when it holds ``metadata.json`` (whatever name template made its name) or, for folders
written without one, when its name has the default ``epoch_E_step_N`` form. Counters come from the metadata, not
from the name. ``.staging-*`` folders are checkpoints still being written: listed only on request, as incomplete.
Other hidden folders (``.deleting-*``, temporary pointer files) and symlinks (the pointers) are never records.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from automodel_ckpt.checkpoint import layout
from automodel_ckpt.checkpoint.metadata import metric_value, read_metadata
from automodel_ckpt.checkpoint.retention import Candidate
from automodel_ckpt.checkpoint.storage import read_pointer


@dataclass(frozen=True)
class CheckpointRecord:
    name: str  # folder name (``.staging-<name>`` for an incomplete one)
    path: Path
    step: int | None  # None only for an incomplete folder whose step is not known yet
    epoch: int | None
    complete: bool  # published: renamed into place (not a staging folder)
    metadata: dict[str, Any] | None  # metadata.json, or None for a folder written without one


def scan(checkpoint_dir: Path, *, include_incomplete: bool = False) -> list[CheckpointRecord]:
    """The checkpoints in ``checkpoint_dir``, oldest (lowest step) first; [] when the folder does not exist."""
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        return []
    records = [r for r in map(_record, checkpoint_dir.iterdir()) if r is not None]
    if not include_incomplete:
        records = [r for r in records if r.complete]
    return sorted(records, key=lambda r: (r.step is None, r.step or 0, r.epoch or 0, not r.complete, r.name))


def _record(path: Path) -> CheckpointRecord | None:
    name = path.name
    staging = layout.is_staging(name)
    if path.is_symlink() or not path.is_dir() or (name.startswith(".") and not staging):
        return None
    meta = read_metadata(path)
    if meta is not None:
        epoch = meta.get("epoch")
        return CheckpointRecord(name, path, meta["step"], epoch if isinstance(epoch, int) else None, not staging, meta)
    parsed = layout.parse_default_name(name[len(layout.STAGING_PREFIX):] if staging else name)
    if parsed is not None:
        return CheckpointRecord(name, path, parsed[1], parsed[0], not staging, None)
    return CheckpointRecord(name, path, None, None, False, None) if staging else None


def pointer_targets(checkpoint_dir: Path) -> dict[str, str | None]:
    """``{pointer: target name}`` for LATEST and LOWEST_VAL (None where a pointer is not set)."""
    return {p: read_pointer(Path(checkpoint_dir), p) for p in layout.POINTERS}


def candidates(records: Iterable[CheckpointRecord], monitor: str, best_metric_key: str | None = None) -> list[Candidate]:
    """The records as retention sees them: name, step, monitored metric, completeness."""
    return [
        Candidate(r.name, r.step, metric_value(r.metadata, monitor, best_metric_key), r.complete)
        for r in records
        if r.step is not None
    ]


def size_on_disk(path: Path) -> int:
    """Bytes of the files below ``path`` (symlinks not followed)."""
    total = 0
    for p in Path(path).rglob("*"):
        try:
            if p.is_file() and not p.is_symlink():
                total += p.lstat().st_size
        except OSError:
            continue  # removed while we looked
    return total
