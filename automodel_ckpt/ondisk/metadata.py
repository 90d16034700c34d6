"""``metadata.json``: what a checkpoint is, in one small file rank 0 writes into every checkpoint.

Non-finite floats are written as the JSON-lines logs write them: NaN as null, infinities as "inf"/"-inf"."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any

from automodel_ckpt.ondisk import bounded, layout
from automodel_ckpt.ondisk.info import WrittenBy
from automodel_ckpt.distributed.mesh import MeshSizes
from automodel_ckpt.errors import CheckpointError
from automodel_ckpt.jsonsafe import json_safe

# Keys of SaveInfo.extra that become top-level metadata fields; other extra keys land under "extra".
_EXTRA_FIELDS = ("consumed_samples", "val_metrics")
# ... and those that do only when given: a run in stages (docs/stages.md) lists them and counts its tokens.
_STAGE_FIELDS = ("stages", "consumed_tokens")


def build_metadata(*, name: str, epoch: int, step: int, train_loss: float | None, val_loss: float | None,
                   is_final: bool, extra: dict[str, Any] | None = None, world_size: int, model_save_format: str,
                   training_seconds: float | None = None, fingerprint: dict[str, Any] | None = None,
                   mesh: dict[str, int] | None = None) -> dict[str, Any]:
    """The metadata of a checkpoint being saved now; ``val_metrics`` flat or per set (``{"squad": {...}}``)."""
    import torch

    from automodel_ckpt import __version__

    extra = dict(extra or {})
    val_metrics: dict[str, Any] = {} if val_loss is None else {"val_loss": val_loss}
    val_metrics.update(extra.get("val_metrics") or {})
    meta: dict[str, Any] = {
        "layout_version": layout.LAYOUT_VERSION,
        "name": name,
        "step": int(step),
        "epoch": int(epoch),
        "consumed_samples": extra.get("consumed_samples"),
        "train_loss": train_loss,
        "val_loss": val_loss,
        "val_metrics": val_metrics,
        "is_final": bool(is_final),
        "saved_at": time.time(),
        "training_seconds": None if training_seconds is None else round(float(training_seconds), 3),
        "world_size": int(world_size),
        "mesh": dict(mesh) if mesh else {"dp_replicate": 1, "dp_shard": int(world_size), "tp": 1},
        "model_save_format": model_save_format,
        "automodel_ckpt_version": __version__,
        "torch_version": torch.__version__.split("+")[0],
    }
    if fingerprint is not None:
        meta["fingerprint"] = fingerprint  # what this is a checkpoint of (ondisk/fingerprint.py)
    meta |= {k: extra[k] for k in _STAGE_FIELDS if k in extra}
    rest = {k: v for k, v in extra.items() if k not in _EXTRA_FIELDS + _STAGE_FIELDS}
    if rest:
        meta["extra"] = rest
    return meta


def write_metadata(checkpoint: Path, meta: dict[str, Any]) -> Path:
    file = Path(checkpoint) / layout.METADATA_FILE
    file.write_text(json.dumps(json_safe(meta), indent=2, default=str) + "\n", encoding="utf-8")
    return file


def read_metadata(checkpoint: Path) -> dict[str, Any] | None:
    """The checkpoint's metadata, or None when it has none (or it is unreadable, or lacks an integer step)."""
    try:
        meta = bounded.read_json(Path(checkpoint) / layout.METADATA_FILE, "checkpoint metadata",
                                 bounded.SMALL_FILE_LIMIT)
    except (OSError, CheckpointError):
        return None
    if not isinstance(meta, dict) or isinstance(meta.get("step"), bool) or not isinstance(meta.get("step"), int):
        return None
    return meta


def as_float(value: Any) -> float | None:
    """A metric read back from JSON: numbers and "inf"/"-inf"/"nan" strings become floats, anything else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        return float(value)
    except ValueError:  # a string that is no number
        return None


def metric_value(meta: dict[str, Any] | None, monitor: str, best_metric_key: str | None = None) -> float | None:
    """``val_metrics[monitor]`` (of set ``best_metric_key`` if given) recorded in ``meta``, or None."""
    if not meta:
        return None
    metrics = meta.get("val_metrics")
    if not isinstance(metrics, dict):
        return None
    if best_metric_key is not None:
        metrics = metrics.get(best_metric_key)
        if not isinstance(metrics, dict):
            return None
    return as_float(metrics.get(monitor))


def _saved_world_size(path: Path) -> int:
    """The world size that wrote checkpoint ``path`` (metadata.json, else the number of per-rank files)."""
    meta = read_metadata(path) or {}
    if meta.get("world_size"):
        return int(meta["world_size"])
    ranks = {parsed[1] for f in Path(path).glob("*/*_dp_rank_*.pt") if (parsed := layout.parse_rank_state_file(f.name))}
    return len(ranks) or 1


def saved_mesh(path: Path) -> MeshSizes:
    """The mesh that wrote checkpoint ``path`` (its metadata's ``mesh``; without one: a 1-D data-parallel mesh)."""
    return MeshSizes.from_record((read_metadata(path) or {}).get("mesh"), _saved_world_size(path))


def written_by(path: Path) -> WrittenBy:
    """How the job that wrote checkpoint ``path`` was shaped (to report what changes on resume)."""
    local: int | None = None
    with contextlib.suppress(OSError, KeyError, TypeError, ValueError, CheckpointError):
        saved = bounded.read_yaml(Path(path) / layout.CONFIG_FILE, "a checkpoint's recipe copy")
        local = int(saved["step_scheduler"]["local_batch_size"])
    return WrittenBy(world_size=_saved_world_size(path), local_batch_size=local, mesh=saved_mesh(path))
