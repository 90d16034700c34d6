"""A checkpoint_dir read as records, and the choice of the checkpoint to resume: what every reader looks at.

A checkpoint holds ``metadata.json`` or has the default name; ``.staging-*`` ones are listed only on request."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from automodel_ckpt.ondisk import bounded, layout
from automodel_ckpt.ondisk.metadata import metric_value, read_metadata
from automodel_ckpt.ondisk.paths import is_plain_name, walk_regular
from automodel_ckpt.ondisk.retention import Candidate, is_better
from automodel_ckpt.ondisk.durable import read_pointer
from automodel_ckpt.errors import CheckpointError


@dataclass(frozen=True)
class CheckpointRecord:
    name: str  # folder name (``.staging-<name>`` for an incomplete one)
    path: Path
    step: int | None  # None only for an incomplete folder whose step is not known yet
    epoch: int | None
    complete: bool  # published: renamed into place (not a staging folder)
    metadata: dict[str, Any] | None  # metadata.json, or None for a folder written without one


def scan_checkpoints(checkpoint_dir: Path, *, include_incomplete: bool = False) -> list[CheckpointRecord]:
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


@dataclass(frozen=True)
class Monitor:
    """"Best by monitor": metric ``name`` (of set ``key``) in each checkpoint's metadata, by ``mode``; finite only."""

    name: str = "val_loss"
    key: str | None = None
    mode: str = "min"

    def value(self, meta: dict[str, Any] | None) -> float | None:
        return metric_value(meta, self.name, self.key)

    def beats(self, meta: dict[str, Any] | None, current: dict[str, Any] | None) -> bool:
        """Whether a checkpoint with metadata ``meta`` beats the one with ``current`` (None: there is none)."""
        return is_better(self.value(meta), self.value(current), self.mode)

    def best(self, records: Iterable[CheckpointRecord]) -> CheckpointRecord | None:
        """The best of ``records`` (the first of equals), or None when none recorded the metric."""
        best: tuple[CheckpointRecord, float] | None = None
        for record in records:
            value = self.value(record.metadata)
            if value is not None and (best is None or is_better(value, best[1], self.mode)):
                best = (record, value)
        return best[0] if best is not None else None


def pointer_targets(checkpoint_dir: Path) -> dict[str, str | None]:
    """``{pointer: target name}`` for LATEST and LOWEST_VAL (None where a pointer is not set)."""
    return {p: read_pointer(Path(checkpoint_dir), p) for p in layout.POINTERS}


def candidates(records: Iterable[CheckpointRecord], monitor: str, best_metric_key: str | None = None) -> list[Candidate]:
    """The records as retention sees them: name, step, monitored metric, completeness."""
    return [Candidate(r.name, r.step, metric_value(r.metadata, monitor, best_metric_key), r.complete)
            for r in records if r.step is not None]


def size_on_disk(path: Path) -> int:
    """Bytes of the files below ``path`` (symlinks not followed)."""
    return sum(size for _, size in walk_regular(path))


def quarantined_checkpoints(checkpoint_dir: Path) -> list[dict[str, Any]]:
    """Checkpoints resume moved aside as damaged: ``{name, path, step, reason, quarantined_at}``, oldest first."""
    folder = Path(checkpoint_dir) / layout.QUARANTINE_DIR
    if folder.is_symlink() or not folder.is_dir():
        return []
    found = []
    for entry in sorted(folder.iterdir()):
        if entry.is_symlink() or not entry.is_dir():
            continue
        try:
            note = bounded.read_json(folder / layout.quarantine_note(entry.name), "a quarantine note",
                                     bounded.SMALL_FILE_LIMIT)
        except (OSError, CheckpointError):
            note = {}
        note = note if isinstance(note, dict) else {}
        when = note.get("quarantined_at")  # any JSON value: only a finite number is a time
        when = when if bounded.is_count(when) or (type(when) is float and math.isfinite(when)) else None
        found.append({"name": entry.name, "path": str(entry), "step": note.get("step"),
                      "reason": note.get("reason"), "quarantined_at": when})
    return sorted(found, key=lambda q: (q["quarantined_at"] or 0, q["name"]))


def pointer_target(checkpoint_dir: Path, pointer: str) -> Path | None:
    """The checkpoint a pointer designates, if it exists and is published."""
    name = read_pointer(checkpoint_dir, pointer)
    if name is None or not is_plain_name(name):  # LATEST.txt holding "..", "/x", "a/b": designates no checkpoint
        return None
    path = Path(checkpoint_dir) / name
    return path if path.is_dir() and not layout.is_staging(name) else None


def _dangling_pointer(checkpoint_dir: Path, pointer: str) -> str | None:
    """The name a pointer targets when that target is not a published checkpoint (else None)."""
    name = read_pointer(checkpoint_dir, pointer)
    if name is None or pointer_target(checkpoint_dir, pointer) is not None:
        return None
    return name


def latest_checkpoint(checkpoint_dir: Path) -> Path | None:
    """LATEST's target; the newest published checkpoint when LATEST is missing, dangling or behind."""
    found = scan_checkpoints(checkpoint_dir)
    target = pointer_target(checkpoint_dir, layout.LATEST)
    if not found:
        return target
    newest = found[-1]
    current = next((r for r in found if target is not None and r.name == target.name), None)
    if target is None or (current is not None and newest.step > current.step):
        return newest.path
    return target


def resolve_restore_from(checkpoint_dir: Path, restore_from: str | None) -> Path | None:
    """The checkpoint to restore: auto (None) → latest or nothing; otherwise it must exist."""
    checkpoint_dir = Path(checkpoint_dir)
    dangling = _dangling_pointer(checkpoint_dir, layout.LATEST)
    if restore_from is None:
        found = latest_checkpoint(checkpoint_dir)
        if dangling is not None:
            fallback = f"resuming from the newest complete checkpoint '{found.name}'" if found else "starting fresh"
            warnings.warn(f"LATEST points to '{dangling}', which is not a checkpoint in {checkpoint_dir}; {fallback}",
                          stacklevel=2)
        return found
    if restore_from == layout.LATEST:
        if dangling is not None:
            existing = ", ".join(r.name for r in scan_checkpoints(checkpoint_dir)) or "none"
            raise CheckpointError(f"checkpoint.restore_from: LATEST points to '{dangling}', which is not a checkpoint "
                                  f"in {checkpoint_dir} (checkpoints there: {existing}); name one, or unset "
                                  "restore_from to resume from the newest")
        found = latest_checkpoint(checkpoint_dir)
    elif restore_from in (layout.LOWEST_VAL, layout.BEST_EVAL):
        found = pointer_target(checkpoint_dir, restore_from)
    else:
        candidate = Path(restore_from).expanduser()
        if candidate.name.endswith(layout.ARCHIVE_SUFFIX) and candidate.is_file():
            return candidate  # an archive (`ckpt-train pack`): the weights are read from it in place
        if not candidate.is_dir():
            candidate = checkpoint_dir / restore_from
        found = candidate if candidate.is_dir() and not layout.is_staging(candidate.name) else None
    if found is None:
        existing = ", ".join(r.name for r in scan_checkpoints(checkpoint_dir)) or "none"
        raise CheckpointError(f"checkpoint.restore_from: '{restore_from}' not found in {checkpoint_dir} "
                              f"(checkpoints there: {existing})")
    return found
