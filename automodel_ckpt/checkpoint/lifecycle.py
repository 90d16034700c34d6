"""Checkpoint lifecycle across ranks: reserve a staging folder, agree on success, publish, select for restore.

A checkpoint becomes visible only when complete: every rank writes into ``.staging-<name>``, the files and
folders are fsynced, ranks agree that nobody failed, and rank 0 renames the folder into place and then swaps the
pointers. A failure on any rank makes every rank raise the same error instead of hanging in a collective.
"""

from __future__ import annotations

import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

from automodel_ckpt.checkpoint import catalog, layout
from automodel_ckpt.checkpoint.retention import RetentionPolicy, to_delete
from automodel_ckpt.checkpoint.storage import fsync_dir, read_pointer, remove_tree, set_pointer
from automodel_ckpt.distributed.env import all_gather_object, barrier, broadcast_object
from automodel_ckpt.errors import CheckpointError

T = TypeVar("T")


def collectively(fn: Callable[[], T], what: str, rank: int) -> T:
    """Run ``fn`` on every rank; if it fails anywhere, raise the first failure's message on every rank."""
    result: T | None = None
    error: str | None = None
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 - every failure must reach every rank
        error = _describe(exc)
        if not isinstance(exc, CheckpointError):
            error += "\n" + traceback.format_exc() if _debug() else ""
    errors = all_gather_object(error)
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if failed:
        r, e = failed[0]
        raise CheckpointError(f"{what} failed on rank {r}: {e.splitlines()[0]}")
    return result  # type: ignore[return-value]


def on_main(fn: Callable[[], T], what: str, rank: int) -> T:
    """Run ``fn`` on rank 0 only; its result (or its failure) reaches every rank."""
    payload: tuple[bool, object] = (True, None)
    if rank == 0:
        try:
            payload = (True, fn())
        except Exception as exc:  # noqa: BLE001
            payload = (False, _describe(exc))
    ok, value = broadcast_object(payload)
    if not ok:
        raise CheckpointError(f"{what} failed on rank 0: {value}")
    return value  # type: ignore[return-value]


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {text}"


def _debug() -> bool:
    import os

    return os.environ.get("AUTOMODEL_CKPT_DEBUG") == "1"


# --- the steps -------------------------------------------------------------------------------------


def reserve(checkpoint_dir: Path, name: str) -> Path:
    """Rank 0: create ``.staging-<name>`` after removing leftovers of interrupted saves. Never overwrites."""
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    final = checkpoint_dir / name
    if final.exists():
        raise CheckpointError(
            f"checkpoint '{final}' already exists and is never overwritten; "
            "restore from the newest checkpoint or use another checkpoint.checkpoint_dir"
        )
    for leftover in checkpoint_dir.iterdir():
        if layout.is_staging(leftover.name) and leftover.is_dir():
            remove_tree(leftover)
    staging = checkpoint_dir / layout.staging_name(name)
    staging.mkdir()
    fsync_dir(checkpoint_dir)
    return staging


def publish(checkpoint_dir: Path, name: str, *, update_lowest_val: bool) -> Path:
    """Rank 0: rename the staged checkpoint into place, then point LATEST (and LOWEST_VAL) at it."""
    staging = checkpoint_dir / layout.staging_name(name)
    final = checkpoint_dir / name
    staging.rename(final)
    fsync_dir(checkpoint_dir)
    set_pointer(checkpoint_dir, layout.LATEST, name)
    if update_lowest_val:
        set_pointer(checkpoint_dir, layout.LOWEST_VAL, name)
    return final


def prune(checkpoint_dir: Path, policy: RetentionPolicy, monitor: str, best_metric_key: str | None = None) -> list[str]:
    """Rank 0, after publish: delete the checkpoints the retention policy gives up (see ``retention``).

    Pointer targets and the newest checkpoint are never deleted, staging folders never touched. Each checkpoint
    is first hidden by a rename (so a crash mid-delete never leaves a half-deleted checkpoint that looks
    complete), then removed. A checkpoint that cannot be deleted is a warning, never an error.
    """
    checkpoint_dir = Path(checkpoint_dir)
    for leftover in checkpoint_dir.iterdir():
        if leftover.name.startswith(layout.DELETING_PREFIX) and leftover.is_dir():
            remove_tree(leftover)
    if not policy.prunes:
        return []
    protected = {t for t in catalog.pointer_targets(checkpoint_dir).values() if t}
    records = catalog.candidates(catalog.scan(checkpoint_dir), monitor, best_metric_key)
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


# --- selection ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointRef:
    name: str
    epoch: int
    step: int
    path: Path


def list_checkpoints(checkpoint_dir: Path) -> list[CheckpointRef]:
    """Published checkpoints, oldest first (staging folders are never listed).

    A checkpoint is a folder with metadata.json (any name template) or, without one, a default-template name;
    its step and epoch come from the metadata (see ``catalog``).
    """
    return [CheckpointRef(r.name, r.epoch or 0, r.step, r.path) for r in catalog.scan(checkpoint_dir)]  # type: ignore[arg-type]


def pointer_target(checkpoint_dir: Path, pointer: str) -> Path | None:
    """The checkpoint a pointer designates, if it exists and is published."""
    name = read_pointer(checkpoint_dir, pointer)
    if name is None:
        return None
    path = Path(checkpoint_dir) / name
    return path if path.is_dir() and not layout.is_staging(name) else None


def dangling_pointer(checkpoint_dir: Path, pointer: str) -> str | None:
    """The name a pointer targets when that target is not a published checkpoint (else None)."""
    name = read_pointer(checkpoint_dir, pointer)
    if name is None or pointer_target(checkpoint_dir, pointer) is not None:
        return None
    return name


def latest_checkpoint(checkpoint_dir: Path) -> Path | None:
    """LATEST's target; the newest published checkpoint when LATEST is missing, dangling or behind.

    LATEST can lag only if a run died between publishing a checkpoint and swapping the pointer.
    """
    found = list_checkpoints(checkpoint_dir)
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
    dangling = dangling_pointer(checkpoint_dir, layout.LATEST)
    if restore_from is None:
        found = latest_checkpoint(checkpoint_dir)
        if dangling is not None:
            fallback = f"resuming from the newest complete checkpoint '{found.name}'" if found else "starting fresh"
            warnings.warn(f"LATEST points to '{dangling}', which is not a checkpoint in {checkpoint_dir}; {fallback}",
                          stacklevel=2)
        return found
    if restore_from == layout.LATEST:
        if dangling is not None:
            existing = ", ".join(r.name for r in list_checkpoints(checkpoint_dir)) or "none"
            raise CheckpointError(
                f"checkpoint.restore_from: LATEST points to '{dangling}', which is not a checkpoint in "
                f"{checkpoint_dir} (checkpoints there: {existing}); name one, or unset restore_from to resume "
                "from the newest"
            )
        found = latest_checkpoint(checkpoint_dir)
    elif restore_from == layout.LOWEST_VAL:
        found = pointer_target(checkpoint_dir, layout.LOWEST_VAL)
    else:
        candidate = Path(restore_from).expanduser()
        if not candidate.is_dir():
            candidate = checkpoint_dir / restore_from
        found = candidate if candidate.is_dir() and not layout.is_staging(candidate.name) else None
    if found is None:
        existing = ", ".join(r.name for r in list_checkpoints(checkpoint_dir)) or "none"
        raise CheckpointError(
            f"checkpoint.restore_from: '{restore_from}' not found in {checkpoint_dir} (checkpoints there: {existing})"
        )
    return found


def wait_all() -> None:
    barrier()
