"""Build objects from ``_target_`` config sections, checking their keys against the target's signature."""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import inspect
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from automodel_ckpt.config.arguments import check_value
from automodel_ckpt.config.loader import omega_message
from automodel_ckpt.errors import ConfigError

__all__ = ["check_arguments", "instantiate", "locate"]

TARGET_KEY = "_target_"
#: Keys of a ``_target_`` section that the recipe reads itself and never passes to the target.
RECIPE_KEYS: dict[str, tuple[str, ...]] = {"model": ("freeze",)}


def locate(path: str, key: str | None = None) -> Any:
    """Import ``pkg.mod.Name`` (or ``pkg.mod.Class.method``) or ``path/to/file.py:Name``; ``key`` names the setting."""
    where = f" for {key}" if key else ""

    def fail(reason: str) -> ConfigError:
        return ConfigError(f"cannot import {path!r}{where}: {reason}")

    if not isinstance(path, str) or not path.strip():
        raise ConfigError(f"cannot import {path!r}{where}: expected 'pkg.module.Name' or 'file.py:Name'")
    file_part, colon, attr_part = path.rpartition(":")
    if colon and (file_part.endswith(".py") or "/" in file_part or "\\" in file_part):
        obj: Any = _load_file_module(file_part, fail)
        return _get_attrs(obj, attr_part.split("."), file_part, fail)
    parts = path.split(".")
    if not all(p.isidentifier() for p in parts):
        raise fail("expected 'pkg.module.Name' or 'file.py:Name'")
    obj = _import(parts[0], fail)
    for i in range(1, len(parts)):
        if hasattr(obj, parts[i]):
            obj = getattr(obj, parts[i])
            continue
        module = _import(".".join(parts[:i + 1]), fail, missing_ok=True) if inspect.ismodule(obj) else None
        if module is None:
            return _get_attrs(obj, parts[i:], ".".join(parts[:i]), fail)
        obj = module
    return obj


def _import(name: str, fail: Any, missing_ok: bool = False) -> Any:
    """The module ``name``; None where ``missing_ok`` and it is not there (an attribute, then)."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if missing_ok and exc.name == name:
            return None
        raise fail(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - any failure while importing user code is a config problem
        raise fail(f"{type(exc).__name__}: {exc}") from None


def _get_attrs(obj: Any, names: list[str], owner: str, fail: Any) -> Any:
    for name in names:
        if not hasattr(obj, name):
            close = difflib.get_close_matches(name, [n for n in dir(obj) if not n.startswith("_")], n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise fail(f"'{owner}' has no attribute '{name}'{hint}")
        obj = getattr(obj, name)
        owner = f"{owner}.{name}"
    return obj


def _load_file_module(file: str, fail: Any) -> Any:
    """Import a ``.py`` file once, under a name derived from its absolute path (so pickling finds it)."""
    resolved = Path(file).expanduser().resolve()
    if not resolved.is_file():
        raise fail(f"file not found: {file}")
    stem = re.sub(r"\W", "_", resolved.stem)
    name = f"_automodel_ckpt_user_{stem}_{hashlib.sha1(str(resolved).encode()).hexdigest()[:10]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise fail(f"not a Python module: {file}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - errors in the user's file are reported as config errors
        del sys.modules[name]
        raise fail(f"{type(exc).__name__}: {exc}") from None
    return module


def _plain(node: Any, section: str) -> Any:
    if isinstance(node, (DictConfig, ListConfig)):
        try:
            return OmegaConf.to_container(node, resolve=True)
        except OmegaConfBaseException as exc:
            key = f"{section}.{exc.full_key}" if exc.full_key else section
            raise ConfigError(f"{key}: {omega_message(exc)}") from None
    if isinstance(node, Mapping):
        return {k: _plain(v, f"{section}.{k}") for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return type(node)(_plain(v, f"{section}[{i}]") for i, v in enumerate(node))
    return node


def _build_nested(value: Any, key: str) -> Any:
    if isinstance(value, Mapping):
        if TARGET_KEY in value:
            return instantiate(value, key, recursive=True)
        return {k: _build_nested(v, f"{key}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [_build_nested(v, f"{key}[{i}]") for i, v in enumerate(value)]
    return value


def instantiate(node: Mapping[str, Any] | DictConfig, section: str, /, *args: Any, recursive: bool = False,
                **extra: Any) -> Any:
    """Call ``node["_target_"]`` with ``*args``, the node's other keys and ``extra`` (which wins)."""
    if node is None or (isinstance(node, DictConfig) and node._is_none()):
        raise ConfigError(f"{section}: nothing to build (the section is null)")
    config = _plain(node, section)
    if not isinstance(config, Mapping):
        raise ConfigError(f"{section}: expected a mapping with '{TARGET_KEY}', got {type(config).__name__}")
    if TARGET_KEY not in config:
        raise ConfigError(f"missing required key '{section}.{TARGET_KEY}'")
    target_name = config[TARGET_KEY]
    target = locate(target_name, f"{section}.{TARGET_KEY}")
    kwargs = {k: v for k, v in config.items() if k != TARGET_KEY and k not in RECIPE_KEYS.get(section, ())}
    if recursive:
        kwargs = {k: _build_nested(v, f"{section}.{k}") for k, v in kwargs.items()}
    kwargs.update(extra)
    if not callable(target):
        raise ConfigError(f"{section}.{TARGET_KEY}: {target_name} is not callable")
    _check_signature(target, target_name, section, args, kwargs)
    try:
        return target(*args, **kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{section}: {target_name}: {exc}") from exc


def check_arguments(node: Mapping[str, Any] | DictConfig, section: str) -> None:
    """A ``_target_`` section's keys and values against its target's signature (a ``file.py`` target's: not)."""
    config = _plain(node, section)
    if not isinstance(config, Mapping) or not isinstance(config.get(TARGET_KEY), str) or ":" in config[TARGET_KEY]:
        return
    target = locate(config[TARGET_KEY], f"{section}.{TARGET_KEY}")
    if callable(target):
        kwargs = {k: v for k, v in config.items() if k != TARGET_KEY and k not in RECIPE_KEYS.get(section, ())}
        _check_signature(target, config[TARGET_KEY], section, (), kwargs, missing=False)


def _check_signature(target: Any, name: str, section: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                     missing: bool = True) -> None:
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return  # builtins without a signature: let the call decide
    params = list(sig.parameters.values())
    kinds = {p.kind for p in params}
    named = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if inspect.Parameter.VAR_KEYWORD not in kinds:
        for key in kwargs:
            if key not in named:
                close = difflib.get_close_matches(key, named, n=1)
                hint = f"(did you mean '{section}.{close[0]}'?)" if close else (
                    "(valid keys: " + ", ".join(f"{section}.{n}" for n in named) + ")" if named else "(it takes none)")
                raise ConfigError(f"unknown key '{section}.{key}' for {name} {hint}")
    by_name = {p.name: p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    for key, value in kwargs.items():
        if key in by_name and not isinstance(value, Mapping):
            check_value(target, by_name[key], value, f"{section}.{key}", name)
    if not missing:
        return
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    filled = {p.name for p in positional[:len(args)]}
    for p in params:
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            if p.name not in filled and p.name not in kwargs:
                raise ConfigError(f"missing required key '{section}.{p.name}' for {name}")
