"""A checkpoint's scores logged to its run's trackers at its step: what `ckpt-train eval` adds there.

The trackers are those of the checkpoint's recipe copy (``logging:``), reopened on the runs its ``tracking`` state
names (``tracking.annotate``), under the names an evaluation during training logs; anything else logs nothing.
"""

from __future__ import annotations

from pathlib import Path

from automodel_ckpt.errors import CheckpointError
from automodel_ckpt.evaluation.during_training import metric_name
from automodel_ckpt.ondisk import CheckpointFolder, load_pt, read_yaml, scan_checkpoints

TRACKING_STATE = "tracking"  # the recipe attribute whose state holds the tracked runs' ids (RunTracker)


def log_scores(checkpoint: Path, scores: dict[str, dict[str, float]], *, outside: bool = False) -> list[str]:
    """Log ``scores`` (``{task: {metric: value}}``) to the trackers of ``checkpoint``'s run at its step; one line
    per tracker (where the points went, or why not); [] when ``checkpoint`` is not a checkpoint of a tracked run."""
    checkpoint = Path(checkpoint)
    record = next((r for r in scan_checkpoints(checkpoint.parent) if r.path.name == checkpoint.name), None)
    recipe = CheckpointFolder(checkpoint).config
    if record is None or record.step is None or not recipe.is_file():
        return []
    try:
        config = read_yaml(recipe, "a checkpoint's recipe copy")
    except (OSError, CheckpointError) as exc:
        return [f"trackers: not logged (cannot read {recipe}: {exc})"]
    section = config.get("logging") if isinstance(config, dict) else None
    if not isinstance(section, dict):
        return []
    state_file = CheckpointFolder(checkpoint).state_file(TRACKING_STATE)
    saved = load_pt(state_file) if state_file.is_file() else {}
    from automodel_ckpt.tracking import annotate

    metrics = {metric_name(task, metric): value for task, values in scores.items() for metric, value in values.items()}
    return annotate(section, checkpoint.parent, saved, metrics, record.step, outside=outside)
