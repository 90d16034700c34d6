"""A run's stages so far (docs/stages.md): the records each checkpoint's metadata lists, checked when read back.

A record: ``name``, ``first_step``, ``samples``, ``tokens``, the keys it ``changed``, the ``lr`` at its first step and
its ``schedule`` (``from``, ``steps``); read back, each field is untrusted, a bad one one line naming it.
"""

from __future__ import annotations

import math
import re
from typing import Any

from automodel_ckpt.errors import CheckpointError
from automodel_ckpt.ondisk import is_count
from automodel_ckpt.shown import shown_value

MAX_STAGES = 1000  # records a checkpoint may list
MAX_CHANGED = 64  # keys a record may name
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_KEY = re.compile(r"^[A-Za-z_][\w-]*(?:\.[\w-]+)*$")


def record(name: str, first_step: int, samples: int, tokens: int | None, changed: list[str], lr: float | None,
           schedule: dict[str, Any] | None) -> dict[str, Any]:
    """A stage's record as the metadata lists it."""
    return {"name": name, "first_step": first_step, "samples": samples, "tokens": tokens,
            "changed": list(changed)[:MAX_CHANGED], "lr": lr, "schedule": schedule}


def read_history(meta: dict[str, Any], where: str) -> tuple[list[dict[str, Any]], int | None]:
    """The stages ``meta`` lists, each field checked, and its token count; ``([], None)`` when none."""
    stages, tokens = meta.get("stages"), meta.get("consumed_tokens")
    if stages is None:
        return [], None
    step = meta.get("step")
    if not isinstance(stages, list) or not 0 < len(stages) <= MAX_STAGES:
        raise CheckpointError(f"{where}: 'stages' is {shown_value(stages)}, not a list of 1 to {MAX_STAGES} stages")
    if tokens is not None and not is_count(tokens):
        raise CheckpointError(f"{where}: 'consumed_tokens' is {shown_value(tokens)}, not a count")
    out: list[dict[str, Any]] = []
    for i, entry in enumerate(stages):
        out.append(_checked(entry, f"{where}: 'stages[{i}]", out[-1] if out else None, step))
    return out, tokens


def _checked(entry: Any, field: str, before: dict[str, Any] | None, step: Any) -> dict[str, Any]:
    """One record, each field within its bounds and after the record ``before`` it."""
    if not isinstance(entry, dict):
        raise CheckpointError(f"{field}' is {shown_value(entry)}, not a stage's record")
    name, first, samples, tokens = (entry.get(k) for k in ("name", "first_step", "samples", "tokens"))
    if not isinstance(name, str) or not _NAME.match(name) or (before is not None and name == before["name"]):
        raise CheckpointError(f"{field}.name' is {shown_value(name)}, not a stage name")
    low = before["first_step"] + 1 if before is not None else 1
    if not is_count(first) or first < low or (is_count(step) and first > step + 1):
        raise CheckpointError(f"{field}.first_step' is {shown_value(first)}, not a step from {low} to the "
                              "checkpoint's step + 1")
    for key, value, least in (("samples", samples, before and before["samples"]),
                              ("tokens", tokens, before and before["tokens"])):
        if value is None and key == "tokens":
            continue
        if not is_count(value) or (least is not None and value < least):
            raise CheckpointError(f"{field}.{key}' is {shown_value(value)}, not a count from the stage before")
    changed = entry.get("changed")
    if not isinstance(changed, list) or len(changed) > MAX_CHANGED or \
            not all(isinstance(k, str) and len(k) <= 200 and _KEY.match(k) for k in changed):
        raise CheckpointError(f"{field}.changed' is {shown_value(changed)}, not a list of recipe keys")
    lr = entry.get("lr")
    if lr is not None and (isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr)
                           or lr < 0):
        raise CheckpointError(f"{field}.lr' is {shown_value(lr)}, not a learning rate")
    return record(name, first, samples, tokens, changed, None if lr is None else float(lr),
                  _schedule(entry.get("schedule"), f"{field}.schedule", first))


def _schedule(value: Any, field: str, first: int) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not is_count(value.get("from")) or value["from"] >= first or \
            not (value.get("steps") is None or (is_count(value["steps"]) and value["steps"] >= 1)):
        raise CheckpointError(f"{field}' is {shown_value(value)}, not a schedule (from: a step before the stage, "
                              "steps: a count >= 1 or null)")
    return {"from": value["from"], "steps": value.get("steps")}


def describe(stages: list[dict[str, Any]]) -> list[str]:
    """One line per stage (``ckpt-train inspect``): its name, first step, what came before it, what it changed."""
    lines = []
    for i, s in enumerate(stages):
        tokens = "" if s.get("tokens") is None else f", {s['tokens']} tokens"
        changed = ", ".join(s.get("changed") or []) or ("the recipe as written" if i == 0 else "nothing changed")
        lines.append(f"  {s.get('name')}: from step {s.get('first_step')} (after {s.get('samples')} samples{tokens})"
                     f": {changed}")
    return lines
