"""The recipe that continues an imported run: the user's recipe with what the source needs, written to the run folder.

``RUN_DIR/recipe.yaml`` is the recipe file as given, the typed overrides applied, then the source's own settings
where the user typed none (``needs``), and ``checkpoint_dir: RUN_DIR``. The import builds that file, so the run it
continues is the one the file describes; a comment header records where it came from.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from typing import Any

from automodel_ckpt.interop.source import ForeignRun
from automodel_ckpt.shown import one_line

ADAMW = ("torch.optim.AdamW", "automodel_ckpt.training.decay.AdamWNoDecay")
NO_DECAY = ADAMW[1]


def _merge(section: dict[str, Any], key: str, value: Any) -> None:
    """``section[key] = value`` as the config loader merges it: a mapping merges key by key unless it names another
    ``_target_`` (which starts the section afresh); anything else replaces."""
    old = section.get(key)
    if isinstance(value, Mapping) and isinstance(old, dict) and \
            ("_target_" not in value or value["_target_"] == old.get("_target_")):
        for sub_key, sub_value in value.items():
            _merge(old, str(sub_key), sub_value)
        return
    section[key] = copy.deepcopy(dict(value)) if isinstance(value, Mapping) else value


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    _merge(node, parts[-1], value)


def needs(run: ForeignRun, data: dict[str, Any], typed: set[str]) -> dict[str, Any]:
    """The dotted settings the source needs that the recipe ``data`` (overrides applied) lacks, but those the user
    typed (``typed``: dotted keys and their sections): what the import adds to the recipe."""
    def untyped(key: str) -> bool:
        parts = key.split(".")
        return not any(".".join(parts[:i]) in typed for i in range(1, len(parts) + 1))

    out: dict[str, Any] = {}
    schedule = run.schedule
    if schedule.target is not None and untyped("lr_scheduler"):
        section = {"_target_": schedule.target, **copy.deepcopy(schedule.kwargs)}
        if data.get("lr_scheduler") != section:
            out["lr_scheduler"] = section
    steps = data.get("step_scheduler") if isinstance(data.get("step_scheduler"), dict) else {}
    if schedule.target is not None and schedule.total_steps is not None and untyped("step_scheduler.max_steps") \
            and steps.get("max_steps") != schedule.total_steps:
        out["step_scheduler.max_steps"] = int(schedule.total_steps)
    optimizer = data.get("optimizer") if isinstance(data.get("optimizer"), dict) else {}
    target = optimizer.get("_target_", ADAMW[0])
    if target not in ADAMW or not run.groups:
        return out  # apply() refuses another optimizer in one line
    decays = [float(g["weight_decay"]) for g in run.groups if g.get("count", 1)]
    decays = decays or [float(run.groups[0]["weight_decay"])]
    first = run.groups[0]
    wanted: dict[str, Any] = {"lr": float(first.get("initial_lr", first["lr"])),
                              "betas": [float(b) for b in first["betas"]], "eps": float(first["eps"]),
                              "weight_decay": max(decays)}
    if len(set(decays)) > 1 and min(decays) == 0.0 and untyped("optimizer._target_"):
        wanted["_target_"] = NO_DECAY  # the HF Trainer's two groups: decay but for biases and norms
    for key, value in wanted.items():
        mine = optimizer.get(key)
        same = mine == value or (isinstance(mine, (int, float)) and isinstance(value, float)
                                 and math.isclose(float(mine), value, rel_tol=1e-12))
        if not same and untyped(f"optimizer.{key}"):
            out[f"optimizer.{key}"] = value
    return out


def inert(value: Any) -> Any:
    """A value the import adds, as data OmegaConf takes literally: a string's ``${...}`` escaped, in mappings and lists
    too (a source's ``oc.env`` interpolation would read the environment when the recipe is loaded)."""
    if isinstance(value, str):
        return value.replace("\\${", "${").replace("${", "\\${")
    if isinstance(value, Mapping):
        return {inert(str(k)): inert(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [inert(v) for v in value]
    return value


def written(original: dict[str, Any], typed: Sequence[tuple[str, Any]], run: ForeignRun,
            run_dir: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The recipe to write (``original`` with the ``typed`` overrides, the source's needs and the run folder) and the
    needs it added."""
    data = copy.deepcopy(original)
    for key, value in typed:
        _set_dotted(data, key, value)
    added = {key: inert(value) for key, value in needs(run, data, {key for key, _ in typed}).items()}
    for key, value in added.items():
        _set_dotted(data, key, value)
    checkpoint = data.get("checkpoint") if isinstance(data.get("checkpoint"), dict) else {}
    checkpoint = data["checkpoint"] = {**checkpoint, "enabled": True, "checkpoint_dir": run_dir}
    checkpoint.pop("restore_from", None)  # the run continues from its own folder
    return data, added


def header(run: ForeignRun, src: str, recipe: str, typed: Sequence[str], added: dict[str, Any]) -> str:
    """The comment lines above the written recipe: its lineage and what the import changed."""
    lines = [f"Written by ckpt-train import: {run.kind} from {src}",
             f"recipe: {recipe}" + (f", with {' '.join(typed)}" if typed else ""),
             "from the source: " + (", ".join(f"{k}={v}" for k, v in added.items()) if added else "nothing")]
    return "".join(f"# {one_line(line)}\n" for line in lines)
