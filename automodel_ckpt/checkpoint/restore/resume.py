"""What a run resumes from: the newest checkpoint that loads, checked before any state changes; damaged ones quarantined.

Auto-resume picks the newest complete checkpoint. A checkpoint can still be damaged after it was published (a bad
disk block, a truncated copy, a partial sync to another filesystem). Before anything is loaded, every rank checks
the candidate together (``probe``): its manifest (sizes always, checksums with ``verify_on_load``), the headers of
its safetensors files, its DCP ``.metadata`` files and its small ``.pt`` state files. If that fails anywhere, every
rank sees the same failure; rank 0 moves the checkpoint to ``quarantine/`` (kept for inspection, never listed as a
checkpoint, named by no pointer), repoints ``LATEST``/``LOWEST_VAL``, and the next newest is tried. Because the
check comes first, a resume after a fallback is bitwise the resume from that older checkpoint.

An explicitly named ``restore_from`` that fails is an error, never a silent fallback; so is any failure with
``checkpoint.on_load_error: error``.
"""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path
from typing import Any, Callable

from automodel_ckpt.checkpoint.disk import catalog, layout, manifest
from automodel_ckpt.checkpoint.disk.metadata import metric_value, read_metadata
from automodel_ckpt.checkpoint.disk.retention import is_better
from automodel_ckpt.checkpoint.formats.safe_load import load_dcp_metadata, load_pt
from automodel_ckpt.checkpoint.formats.safetensors_io import read_header
from automodel_ckpt.checkpoint.disk.durable import fsync_dir, remove_pointer, set_pointer
from automodel_ckpt.errors import CheckpointError, first_line


def probe(path: Path, *, checksums: bool, rank: int, world_size: int,
          warn: Callable[[str], None] | None = None) -> None:
    """Raise ``CheckpointError`` if ``path`` cannot be loaded; reads headers and indexes only, changes nothing.

    Run on every rank (inside ``collective.collectively``): the manifest check splits checksum work over ranks;
    rank 0 reads every safetensors header and DCP index; each rank reads the per-rank files it will load.
    """
    path = Path(path)
    manifest.check_before_load(path, checksums=checksums, rank=rank, world_size=world_size, warn=warn)
    if rank == 0:
        for file in sorted(path.rglob("*.safetensors")):
            if _exported(path, file):
                continue
            read_header(file)
        for file in sorted(path.rglob(layout.DCP_METADATA)):
            load_dcp_metadata(file)
        for file in sorted(path.glob("*.pt")):
            _readable_pt(file)
    for file in sorted(path.glob(f"*/*_dp_rank_{rank}.pt")):
        _readable_pt(file)


def _warn(message: str) -> None:
    warnings.warn(message, stacklevel=2)


def _exported(root: Path, file: Path) -> bool:
    """Files of an HF export inside the checkpoint (``model/consolidated``, ``model/merged``): not resume state."""
    parts = file.relative_to(root).parts
    return len(parts) > 2 and parts[1] in (layout.CONSOLIDATED_DIR, layout.MERGED_DIR)


def _readable_pt(file: Path) -> None:
    try:
        load_pt(file)
    except CheckpointError as exc:  # truncated, garbled, a pickle of anything but plain data, no regular file
        raise CheckpointError(f"'{file}' is unreadable: {str(exc).split(': ', 1)[-1]}") from None


def quarantine(checkpoint_dir: Path, name: str, reason: str, *, monitor: str = "val_loss",
               best_metric_key: str | None = None, mode: str = "min") -> Path:
    """Rank 0: move checkpoint ``name`` to ``quarantine/`` with a note saying why; repoint the pointers.

    ``LATEST`` then names the newest checkpoint left (or is removed), ``LOWEST_VAL`` the best one left by
    ``monitor`` (or is removed). Returns the checkpoint's new path.
    """
    checkpoint_dir = Path(checkpoint_dir)
    folder = checkpoint_dir / layout.QUARANTINE_DIR
    folder.mkdir(exist_ok=True)
    target = folder / name
    n = 1
    while target.exists():  # the same step damaged twice (a rerun wrote it again): keep both
        n += 1
        target = folder / f"{name}.{n}"
    meta = read_metadata(checkpoint_dir / name) or {}
    (checkpoint_dir / name).rename(target)
    note = {"name": name, "step": meta.get("step"), "reason": reason, "quarantined_at": time.time()}
    (folder / layout.quarantine_note(target.name)).write_text(json.dumps(note, indent=2) + "\n", encoding="utf-8")
    fsync_dir(folder)
    fsync_dir(checkpoint_dir)
    _repoint(checkpoint_dir, name, monitor, best_metric_key, mode)
    return target


def _repoint(checkpoint_dir: Path, gone: str, monitor: str, best_metric_key: str | None, mode: str) -> None:
    remaining = catalog.list_checkpoints(checkpoint_dir)
    pointers = catalog.pointer_targets(checkpoint_dir)
    if pointers.get(layout.LATEST) == gone:
        if remaining:
            set_pointer(checkpoint_dir, layout.LATEST, remaining[-1].name)
        else:
            remove_pointer(checkpoint_dir, layout.LATEST)
    if pointers.get(layout.LOWEST_VAL) == gone:
        best = None
        for record in remaining:
            value = metric_value(record.metadata, monitor, best_metric_key)
            if value is not None and (best is None or is_better(value, best[1], mode)):
                best = (record.name, value)
        if best is not None:
            set_pointer(checkpoint_dir, layout.LOWEST_VAL, best[0])
        else:
            remove_pointer(checkpoint_dir, layout.LOWEST_VAL)


# --- the choice -------------------------------------------------------------------------------------------


def restore(ckpt: Any, states: dict[str, Any]) -> Path | None:
    """``Checkpointer.restore``: select, check and load; returns the checkpoint loaded, or None for a fresh start."""
    from automodel_ckpt.checkpoint import collective
    from automodel_ckpt.checkpoint.config import LoadErrorPolicy

    cfg, rank = ckpt.cfg, ckpt.env.rank
    if not cfg.enabled and cfg.restore_from is None:
        return None
    auto = cfg.restore_from is None
    if cfg.load_only:
        # The run's own checkpoints come first: a rerun of a run that started from other weights resumes itself.
        own = cfg.enabled and collective.on_main(lambda: catalog.latest_checkpoint(ckpt.dir) is not None,
                                                 "listing checkpoints", rank)
        if not own:
            from automodel_ckpt.checkpoint.restore.initial_weights import start_from

            return start_from(ckpt, states, cfg.restore_from, cfg.load_only)
        auto = True
    while True:
        path = ckpt.find_restore_target(auto=auto)
        if path is None:
            return None
        unfetched = _fetch(ckpt, path)  # a checkpoint on an object store: its files into the local mirror first
        if unfetched is None:
            check_same_run(path, ckpt.fingerprint, ckpt.dir)  # every rank reads the same small file: same verdict
        try:
            if unfetched is not None:  # a missing or unreadable object: damaged like a missing file
                raise unfetched
            collective.collectively(
                lambda: probe(path, checksums=cfg.verify_on_load, rank=rank, world_size=ckpt.env.world_size,
                              warn=_warn),
                f"checking '{path}'", rank)
        except CheckpointError as exc:
            if not auto or cfg.on_load_error == LoadErrorPolicy.ERROR:
                raise
            reason = first_line(exc)
            if reason.startswith(f"checking '{path}' failed on rank "):  # keep what is wrong, not the wrapper
                reason = reason.split(": ", 1)[-1]
            moved = collective.on_main(lambda: _quarantine(ckpt, path.name, reason),
                                       "moving the damaged checkpoint aside", rank)
            if ckpt.env.is_main:
                ckpt.say(f"warning: checkpoint '{path.name}' cannot be loaded ({reason}); moved it to {moved} "
                         "and resuming from the newest checkpoint before it")
            continue
        ckpt.load(states, path, checked=True)
        return path


def _fetch(ckpt: Any, path: Path) -> CheckpointError | None:
    try:
        ckpt.fetch(path)
    except CheckpointError as exc:
        return exc
    return None


def _quarantine(ckpt: Any, name: str, reason: str) -> str:
    cfg = ckpt.cfg
    moved = quarantine(ckpt.dir, name, reason, monitor=cfg.monitor, best_metric_key=cfg.best_metric_key,
                       mode=str(cfg.mode))
    if getattr(ckpt, "remote", None) is not None:  # on an object store: a note object, and the pointers re-set
        ckpt.remote.quarantine(name, reason)
        return f"{ckpt.remote.url}/{layout.QUARANTINE_DIR}/ (and {moved})"
    return str(moved)


def check_same_run(path: Path, fingerprint: dict[str, Any] | None, checkpoint_dir: Path) -> None:
    """``CheckpointError`` when checkpoint ``path`` belongs to another run (model, tokenizer, data...)."""
    from automodel_ckpt.checkpoint.disk.fingerprint import first_difference

    saved = (read_metadata(path) or {}).get("fingerprint")
    difference = first_difference(saved, fingerprint)
    if difference is not None:
        raise CheckpointError(
            f"'{path}' is a checkpoint of another run: {difference}. Use a new checkpoint.checkpoint_dir (this one: "
            f"'{checkpoint_dir}'), or start from its weights with checkpoint.restore_from={path} and "
            "checkpoint.load_only=[model]"
        )
