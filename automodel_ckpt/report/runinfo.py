"""A run folder as plain values: its checkpoints (``inspect``'s rows), eval scores, data position, stages."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from automodel_ckpt.checkpoint import source_of, stored_files, stored_sharing
from automodel_ckpt.distributed.mesh import MeshSizes
from automodel_ckpt.errors import UserError
from automodel_ckpt.jsonsafe import json_safe
from automodel_ckpt.ondisk import (CONFIG_FILE_LIMIT, INDEX_FILE_LIMIT, SMALL_FILE_LIMIT, CheckpointFolder,
                                   CheckpointRecord, HFFolder, ModelFolder, as_float, pointer_target, pointer_targets,
                                   quarantined_checkpoints, read_json, scan_checkpoints, shared_bytes, size_on_disk,
                                   stored_once)


def inspect_dir(path: Path) -> dict[str, Any]:
    """The listing of a checkpoint_dir (or of the one checkpoint ``path`` names) as plain JSON-ready values."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise UserError(f"checkpoint folder '{path}' not found")
    only = None
    if CheckpointFolder(path).metadata.is_file():  # a checkpoint itself: show its row in its run folder
        path, only = path.resolve().parent, path.resolve().name
    pointers = pointer_targets(path)
    records = scan_checkpoints(path, include_incomplete=True)
    # an object store's mirror: files shared as the run's pieces (checkpoint.incremental), over all its checkpoints
    pieces = stored_sharing(path, [r.name for r in records]) if records and source_of(records[0].path) else None
    rows = [_row(r, pointers, pieces[0] if pieces else None) for r in records if only is None or r.name == only]
    totals = {"count": len(rows), "complete": sum(r["complete"] for r in rows),
              "size_bytes": sum(r["size_bytes"] for r in rows)}
    if pieces is not None and only is None:  # each piece stored once
        totals["stored_bytes"] = pieces[1]
    elif any(r.get("shared_bytes") for r in rows) and pieces is None:  # files shared by hard link counted once
        totals["stored_bytes"] = stored_once([path / r["name"] for r in rows if r.get("shared_bytes") is not None])
    return {
        "checkpoint_dir": str(path),
        "pointers": {p: {"target": t, "exists": pointer_target(path, p) is not None}
                     for p, t in pointers.items()},
        "checkpoints": rows,
        "quarantined": quarantined_checkpoints(path) if only is None else [],
        "totals": totals,
    }


def _row(record: CheckpointRecord, pointers: dict[str, str | None],
         pieces: dict[str, tuple[int, int]] | None = None) -> dict[str, Any]:
    meta = record.metadata or {}
    extra = meta.get("extra") if isinstance(meta.get("extra"), dict) else {}  # a received folder's: any JSON
    stored = stored_files(record.path) if source_of(record.path) else None  # a mirror: the store's files
    own_shared = (shared_bytes(record.path) if stored is None
                  else pieces.get(record.name, (None, None)) if pieces is not None else (None, None))
    return {
        "name": record.name,
        "step": record.step,
        "epoch": record.epoch,
        "consumed_samples": meta.get("consumed_samples"),
        "counters": extra.get("counters"),  # an algorithm's own (a preference run's dpo_step)
        "train_loss": json_safe(as_float(meta.get("train_loss"))),
        "val_loss": json_safe(as_float(meta.get("val_loss"))),
        "size_bytes": sum(stored.values()) if stored is not None else size_on_disk(record.path),
        # own: bytes only this checkpoint holds; shared: files it shares with another checkpoint by hard link (on
        # an object store: as a piece another checkpoint references too)
        **dict(zip(("own_bytes", "shared_bytes"), own_shared)),
        "family": model_family(record.path),
        "format": meta.get("model_save_format") or _detected_format(record.path),
        "mesh": _mesh(meta),
        "consolidated": CheckpointFolder(record.path).model.consolidated.is_dir() if stored is None else
        any(rel.startswith(f"{CheckpointFolder.model}/{ModelFolder.consolidated}/") for rel in stored),
        "complete": record.complete,
        "pointers": [p for p, target in pointers.items() if target == record.name],
        "data_position": extra.get("data_position"),
        "eval": eval_scores(record.path),
        "metadata": record.metadata,
    }


def eval_scores(ckpt: Path) -> dict[str, float] | None:
    """``ckpt-train eval``'s scores kept in the checkpoint: ``{"task/metric": value}``, the first metric of each
    task (None when it was never evaluated; a results file that cannot be read is left out)."""
    pattern = CheckpointFolder(ckpt).eval_results("*")
    folder = pattern.parent
    if folder.is_symlink() or not folder.is_dir():
        return None
    scores: dict[str, float] = {}
    for path in sorted(folder.glob(pattern.name)):
        try:
            results = read_json(path, "eval results", INDEX_FILE_LIMIT).get("results") or {}
            for task, values in results.items():
                metric = next(k for k, v in values.items() if "," in k and "_stderr" not in k
                              and isinstance(v, (int, float)) and not isinstance(v, bool))
                scores[f"{task}/{metric.split(',')[0]}"] = float(values[metric])
        except (OSError, AttributeError, StopIteration, TypeError, UserError):
            continue
    return scores or None


def _detected_format(checkpoint: Path) -> str | None:
    """The model format of a checkpoint whose metadata does not name it (an early release's), from its files. Only
    then are the format modules (and torch with them) imported: reading a run folder needs neither."""
    from automodel_ckpt.ondisk import detect_model_format

    return detect_model_format(CheckpointFolder(checkpoint).model.path)


def _mesh(meta: dict[str, Any]) -> str | None:
    """The mesh that wrote the checkpoint, as the resume line says it: ``dp 4``, ``dp 2 × tp 2``, ``HSDP 2 × 2``."""
    if not meta.get("world_size"):
        return None
    try:
        return MeshSizes.from_record(meta.get("mesh"), int(meta["world_size"])).describe()
    except (TypeError, ValueError):
        return None


def model_family(ckpt: Path) -> str | None:
    """The model's ``model_type`` (llama, mixtral, ...), from the saved HF config or the adapter's base."""
    model = CheckpointFolder(ckpt).model
    candidates = [(model.hf_metadata.config, False)]
    with contextlib.suppress(OSError, TypeError, AttributeError, UserError):
        adapter = read_json(model.adapter_config, "an adapter config", SMALL_FILE_LIMIT)
        if adapter.get("base_model_name_or_path"):  # a base folder, maybe a Hugging Face cache snapshot of links
            candidates.append((HFFolder(adapter["base_model_name_or_path"]).config, True))
    for path, follow in candidates:
        try:
            value = read_json(path, "a model config", CONFIG_FILE_LIMIT, follow=follow).get("model_type")
        except (OSError, AttributeError, UserError):
            continue
        if value:
            return str(value)
    return None


def data_position_line(name: str, position: dict[str, Any]) -> str:
    """A streamed corpus's position at checkpoint ``name``: sequences, then per source where it reads and the
    tokens it gave."""
    parts = [f"source {i}: epoch {s.get('epoch')}, shard {s.get('shard')} of {s.get('shards')} ({s.get('path')}) "
             f"row {s.get('row')}, {s.get('tokens')} tokens consumed"
             for i, s in enumerate(position.get("sources") or [])]
    skipped = f", {position['skipped_rows']} bad rows skipped" if position.get("skipped_rows") else ""
    lanes = (f"; {position['lanes']} lanes (this rank {position.get('lanes_read')}), position "
             f"{position.get('position_bytes', 0) / 1024:.1f} KiB") if position.get("lanes") else ""
    return f"data position at {name}: {position.get('sequences')} sequences{skipped}{lanes}; " + "; ".join(parts)


def stages_lines(name: str, meta: dict[str, Any]) -> list[str]:
    """The stages checkpoint ``name``'s metadata lists, one line each (a list that fails its checks: why)."""
    from automodel_ckpt.training.stages import describe, read_history

    try:
        stages, tokens = read_history(meta, f"{name}/{CheckpointFolder.metadata}")
    except UserError as exc:
        return [f"stages at {name}: not readable ({exc})"]
    counted = "" if tokens is None else f", {tokens} tokens trained"
    return [f"stages at {name} (step {meta.get('step')}{counted}):", *describe(stages)]
