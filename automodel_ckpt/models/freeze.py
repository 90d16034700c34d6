"""``model.freeze``: which parameters a run does not train, from names, globs and named groups of the model's parts."""

from __future__ import annotations

from collections.abc import Sequence
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any

from automodel_ckpt.errors import ConfigError
from automodel_ckpt.model_parts import vision_module_paths

if TYPE_CHECKING:
    from torch import nn

__all__ = ["GROUPS", "apply_freeze", "check_freeze_section", "parameter_line", "resolve_freeze"]

#: The named groups ``model.freeze`` takes besides parameter names and globs.
GROUPS: tuple[str, ...] = ("vision_tower", "embeddings", "lm_head", "language_model")
_PEFT_PREFIX = "base_model.model."  # a LoRA-wrapped model's names: the base's names under PEFT's prefix


def check_freeze_section(value: Any) -> list[str]:
    """The patterns of ``model.freeze`` (a list of non-empty strings, or one string), or a one-line ``ConfigError``."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    elif isinstance(value, Sequence):
        value = list(value)
    if not isinstance(value, list):
        raise ConfigError(f"model.freeze: expected a list of parameter names, globs or groups "
                          f"({', '.join(GROUPS)}), got {type(value).__name__}")
    patterns = []
    for item in value:
        if not isinstance(item, str) or not item.strip():
            raise ConfigError(f"model.freeze: expected parameter names, globs or groups ({', '.join(GROUPS)}), "
                              f"got {item!r}")
        patterns.append(item.strip())
    return patterns


def _module_parameters(module: Any) -> set[int]:
    return {id(p) for p in module.parameters()} if module is not None else set()


def _group(model: nn.Module, group: str) -> set[int]:
    """The parameters (by identity) of a named group of ``model``: transformers' accessors, else module names."""
    if group in ("embeddings", "lm_head"):
        getter = {"embeddings": "get_input_embeddings", "lm_head": "get_output_embeddings"}[group]
        return _module_parameters(_call(getattr(model, getter, None)))
    named = dict(model.named_modules())
    if group == "vision_tower":
        paths = vision_module_paths(model, towers=True, projectors=False)
        return {i for path in paths for i in _module_parameters(named[path])}
    # language_model: everything outside the vision tower and the projector (decoder, embeddings, head)
    vision = {i for path in vision_module_paths(model) for i in _module_parameters(named[path])}
    return {id(p) for p in model.parameters()} - vision


def _call(getter: Any) -> Any:
    if getter is None:
        return None
    try:
        return getter()
    except (AttributeError, NotImplementedError):
        return None


def _names(name: str) -> tuple[str, ...]:
    """A parameter's names a pattern may use: as the model names it, and without PEFT's prefix."""
    return (name, name[len(_PEFT_PREFIX):]) if name.startswith(_PEFT_PREFIX) else (name,)


def _matches(pattern: str, name: str) -> bool:
    """A glob (``fnmatch``) over a parameter's name; a module's name (or glob) matches every parameter below it."""
    return any(fnmatchcase(n, pattern) or fnmatchcase(n, pattern + ".*") for n in _names(name))


def resolve_freeze(model: nn.Module, patterns: Sequence[str]) -> list[str]:
    """The names of ``model``'s parameters the patterns name, in order; ``ConfigError`` for one that names none."""
    params = list(model.named_parameters())
    chosen: set[int] = set()
    for pattern in patterns:
        if pattern in GROUPS:
            ids = _group(model, pattern)
        else:
            ids = {id(p) for name, p in params if _matches(pattern, name)}
        if not ids:
            what = (f"this model has no {pattern}" if pattern in GROUPS else
                    "no parameter of the model has that name (a name, a glob, a module's name, or one of "
                    f"{', '.join(GROUPS)}; `ckpt-train inspect` lists a checkpoint's tensor names)")
            raise ConfigError(f"model.freeze: '{pattern}' matches nothing: {what}")
        chosen |= ids
    return [name for name, p in params if id(p) in chosen]


def apply_freeze(model: nn.Module, patterns: Any) -> list[str]:
    """Stop training (no gradient, no optimizer state) the parameters ``model.freeze`` names; their names."""
    patterns = check_freeze_section(patterns)
    if not patterns:
        return []
    names = resolve_freeze(model, patterns)
    chosen = set(names)
    adapters = [n for n, p in model.named_parameters() if n in chosen and p.requires_grad and n.startswith(_PEFT_PREFIX)]
    if adapters:  # a LoRA checkpoint holds the trained adapter weights only: a frozen adapter would not be saved
        raise ConfigError(f"model.freeze: {', '.join(patterns)} would freeze {len(adapters)} LoRA adapter weight(s) "
                          f"(e.g. '{adapters[0]}'); LoRA trains only its adapters, so leave those modules out of "
                          "peft.target_modules (or peft.vision_tower: false) instead")
    for name, param in model.named_parameters():
        if name in chosen:
            param.requires_grad_(False)
    return names


def parameter_line(model: nn.Module, patterns: Sequence[str] | None = None) -> str:
    """The start line: how many parameters train and how many are frozen (a tied weight counted once)."""
    params = list(model.parameters())  # a shared weight once
    trainable = sum(p.numel() for p in params if p.requires_grad)
    frozen = sum(p.numel() for p in params if not p.requires_grad)
    why = f" (model.freeze: {', '.join(patterns)})" if patterns else ""
    return f"Parameters: {_count(trainable)} trainable / {_count(frozen)} frozen{why}"


def _count(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.2f}{unit} ({n:,})"
    return str(n)
