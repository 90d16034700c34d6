"""Points added afterwards to a run's tracked runs at a step they already have: what `ckpt-train eval` logs there.

The runs the checkpoint names are reopened as they are, where its recipe says training kept them; a tracker outside
the run folder (credentials would go there) only when the caller allows it. W&B takes only increasing steps: not it.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from automodel_ckpt.errors import first_line
from automodel_ckpt.tracking.base import OpenContext
from automodel_ckpt.tracking.tracker import BACKENDS, RUN_ID


def annotate(section: Any, run_dir: Path, saved: Any, metrics: dict[str, float], step: int, *,
             outside: bool = False) -> list[str]:
    """Add ``metrics`` at ``step`` to the tracked runs ``saved`` names; one line per tracker, where or why not."""
    if not isinstance(section, dict) or not metrics:
        return []
    saved = saved if isinstance(saved, dict) else {}
    run_dir = Path(run_dir)
    lines = []
    for kind in BACKENDS:
        if section.get(kind.name) is None:
            continue
        name = f"logging.{kind.name}"
        if not kind.appends:
            lines.append(f"{name}: not logged (its history takes only increasing steps)")
            continue
        if importlib.util.find_spec(kind.module) is None:
            lines.append(f"{name}: not logged ('{kind.module}' is not installed)")
            continue
        conf = section.get(kind.name)
        backend = kind(conf if isinstance(conf, dict) else {})
        location = backend.location(run_dir, run_dir.name)
        state = saved.get(kind.name) if isinstance(saved.get(kind.name), dict) else {}
        where = state.get("location", state.get(kind.legacy_location_key) if kind.legacy_location_key else None)
        ids = {k: v for k in ("run_id", "run_key") if isinstance(v := state.get(k), str) and RUN_ID.fullmatch(v)}
        if where is not None and not backend.same_location(where, location):
            lines.append(f"{name}: not logged (the run was tracked at {where}, the recipe names {location} from "
                         "here: run eval from the folder training was launched from)")
            continue
        if not outside and not _inside(backend.local_path(location), run_dir):
            lines.append(f"{name}: not logged ({location} is outside the run folder; --track-outside-run sends the "
                         "scores there)")
            continue
        ctx = OpenContext(run_dir, run_dir.name, location, {}, ids, None, 0, append=True)
        try:
            backend.open(ctx)
            backend.log_metrics(metrics, step)
            backend.flush()
            backend.close("complete")
        except Exception as exc:  # noqa: BLE001 - a tracker is side work: one line, the scores are on disk
            lines.append(f"{name}: not logged ({type(exc).__name__}: {first_line(exc)})")
            continue
        lines.append(f"{name}: {len(metrics)} score(s) at step {step} ({location})")
    return lines


def _inside(path: Path | None, run_dir: Path) -> bool:
    """``path`` (None: a server) lies in the run folder, links resolved."""
    if path is None:
        return False
    real, root = os.path.realpath(path), os.path.realpath(run_dir)
    return os.path.commonpath([real, root]) == root
