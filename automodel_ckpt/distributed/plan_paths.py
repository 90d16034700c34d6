"""The module paths of a model that a parallel plan's patterns (``*``: one path segment) name."""

from __future__ import annotations

import re

from torch import nn


def module_paths(model: nn.Module, pattern: str) -> list[str]:
    """The paths of ``model``'s modules that ``pattern`` matches whole, in ``named_modules`` order."""
    regex = re.compile("\\.".join("[^.]+" if part == "*" else re.escape(part) for part in pattern.split(".")))
    return [name for name, _ in model.named_modules() if regex.fullmatch(name)]
