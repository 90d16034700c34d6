"""Whether a config value fits the parameter of a ``_target_`` it is passed to: the annotation, else the default.

``--optimizer.lr abc`` is one line naming the key, not a failure deep inside AdamW. Only what is sure is refused: YAML
values against plain annotations (``int``, ``float``, ``bool``, ``str``, ``Literal``, containers, unions); anything
else is left to the target, and without an annotation a number or boolean default only refuses a string.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import enum
import inspect
import types
import typing
from typing import Any

from automodel_ckpt.errors import ConfigError
from automodel_ckpt.redact import REDACTED, is_secret_key

__all__ = ["check_value", "describe_value", "type_name"]

_SEQUENCES = (list, tuple, set, frozenset, collections.abc.Sequence, collections.abc.Iterable,
              collections.abc.Collection, collections.abc.MutableSequence)
_MAPPINGS = (dict, collections.abc.Mapping, collections.abc.MutableMapping)


def check_value(target: Any, param: inspect.Parameter, value: Any, key: str, target_name: str) -> None:
    """Raise ConfigError (one line) when ``value`` cannot be what ``param`` of ``target`` takes."""
    if value is None:
        return  # `x: int = None` is common; null is left to the target
    tp = _annotation(target, param)
    if tp is inspect.Parameter.empty:
        default = param.default
        if isinstance(default, (bool, int, float)) and isinstance(value, str):
            tp = type(default)
        else:
            return
    if _accepts(tp, value) is False:
        raise ConfigError(f"{key}: expected {type_name(tp)} for {target_name}, got {describe_value(value, key)}")


def _annotation(target: Any, param: inspect.Parameter) -> Any:
    """The parameter's annotation, resolved alone (a name imported for type checkers leaves only it unknown)."""
    ann = param.annotation
    if not isinstance(ann, str):
        return ann
    fn = target.__init__ if isinstance(target, type) else target
    one = types.SimpleNamespace(__annotations__={param.name: ann},
                                __globals__=getattr(inspect.unwrap(fn), "__globals__", {}))
    try:
        return typing.get_type_hints(one)[param.name]
    except Exception:  # noqa: BLE001 - a name imported only for type checkers: unknown
        return inspect.Parameter.empty


def _members(tp: Any) -> tuple[Any, ...] | None:
    origin = typing.get_origin(tp)
    return typing.get_args(tp) if origin is typing.Union or origin is types.UnionType else None


def _accepts(tp: Any, value: Any) -> bool | None:
    """True: fits; False: cannot fit; None: not known here (left to the target)."""
    if tp in (Any, object, inspect.Parameter.empty) or isinstance(tp, (str, typing.TypeVar)):
        return None
    members = _members(tp)
    if members is not None:
        results = [_accepts(m, value) for m in members]
        return True if True in results else None if None in results else False
    if tp is None or tp is type(None):
        return value is None
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return value in args
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return not isinstance(value, (list, tuple, collections.abc.Mapping))  # `revision: 2024` may still do
    if (origin or tp) in _MAPPINGS:
        return isinstance(value, collections.abc.Mapping)
    if (origin or tp) in _SEQUENCES:
        if not isinstance(value, (list, tuple)):
            return False
        return _items_fit(origin or tp, args, list(value))
    if isinstance(tp, type) and isinstance(value, tp):
        return True
    return False if _is_tensor(tp) else None  # a tensor never comes from YAML


def _items_fit(origin: Any, args: tuple[Any, ...], items: list[Any]) -> bool | None:
    if not args:
        return True
    if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
        if len(args) != len(items):
            return False
        pairs = list(zip(args, items))
    else:
        pairs = [(args[0], item) for item in items]
    results = [_accepts(t, item) for t, item in pairs]
    return False if False in results else True


def type_name(tp: Any) -> str:
    """A type as a config error names it: ``int or null``, ``a list of str``, ``one of 'a', 'b'``."""
    if tp is Any or tp is None:
        return "any"
    members = _members(tp)
    if members is not None:
        names = [type_name(m) for m in members if m is not type(None) and not _is_tensor(m)]
        text = " or ".join(dict.fromkeys(names)) or "a value"
        return f"{text} or null" if type(None) in members else text
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return f"{tp.__name__} (one of " + ", ".join(m.name for m in tp) + ")"
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return f"a {tp.__name__} mapping"
    if (origin or tp) in _MAPPINGS:
        return "a mapping"
    if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
        return f"a list of {len(args)} ({', '.join(type_name(a) for a in args)})"
    if (origin or tp) in _SEQUENCES:
        return f"a list of {type_name(args[0])}" if args else "a list"
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def describe_value(value: Any, key: str = "") -> str:
    """A value for an error message; a secret's (by its key, ``redact.py``) is never shown."""
    if value is not None and (is_secret_key(key) or "storage_options" in key.split(".")):
        return f"{REDACTED} ({type(value).__name__})"
    return "null" if value is None else f"{value!r} ({type(value).__name__})"


def _is_tensor(tp: Any) -> bool:
    return isinstance(tp, type) and tp.__module__.startswith("torch") and tp.__name__ == "Tensor"
