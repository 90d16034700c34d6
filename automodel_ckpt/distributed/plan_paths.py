"""Reading a family's parallel plan: whether it applies here, and the module paths its patterns name."""

from __future__ import annotations

import re

from torch import nn

from automodel_ckpt.errors import ConfigError


def module_paths(model: nn.Module, pattern: str) -> list[str]:
    """The paths of ``model``'s modules that ``pattern`` matches whole, in ``named_modules`` order."""
    regex = re.compile("\\.".join("[^.]+" if part == "*" else re.escape(part) for part in pattern.split(".")))
    return [name for name, _ in model.named_modules() if regex.fullmatch(name)]


def check_plan(key: str, size: int, family: str, plan: dict[str, str], supported: tuple[str, ...], *, kind: str,
               source: str, named: str = "") -> None:
    """One-line ``ConfigError`` for ``distributed.<key>`` when the family has no ``kind`` plan (``source`` says where
    transformers keeps it) or the plan uses a style not applied here (``named``: how that message names the plan)."""
    if not plan:
        raise ConfigError(f"distributed.{key} {size}: the model family '{family}' has no {kind} plan ({source}); "
                          f"use {key} 1")
    unknown = sorted({s for s in plan.values() if s not in supported})
    if unknown:
        raise ConfigError(f"distributed.{key} {size}: the '{family}' {named}plan uses {', '.join(unknown)}, not "
                          f"supported yet (supported: {', '.join(supported)}); use {key} 1")
