"""Load a YAML recipe plus ``--dotted.key value`` overrides into a validated OmegaConf config."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import InterpolationValidationError, OmegaConfBaseException, ValidationError

from automodel_ckpt.ondisk import MAX_DEPTH, yaml_depth_line
from automodel_ckpt.config.arguments import describe_value, type_name
from automodel_ckpt.config.sections import with_sections
from automodel_ckpt.redact import redacted
from automodel_ckpt.errors import ConfigError

__all__ = ["apply_values", "load_config", "load_yaml", "parse_value", "resolve", "split_overrides", "to_yaml",
           "to_yaml_data"]

# YAML 1.1 (PyYAML) reads `1e-4` and `1.0e5` as strings; YAML 1.2 and Python read them as floats.
_EXP_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")
_KEY_RE = re.compile(r"^[A-Za-z_][\w-]*(?:\.[\w-]+)*$")
_FLOAT_TAG = "tag:yaml.org,2002:float"


class _Loader(yaml.SafeLoader):
    """Safe loader with exponent floats, no timestamps and an error on duplicate keys."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        self.flatten_mapping(node)
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:
                continue  # unhashable: the base class reports it
            if duplicate:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


class _Dumper(yaml.SafeDumper):
    """Safe dumper that quotes every string `_Loader` would read back as something else."""


for _cls in (_Loader, _Dumper):
    _cls.add_implicit_resolver(_FLOAT_TAG, _EXP_FLOAT, list("-+0123456789."))
_Loader.yaml_implicit_resolvers = {
    ch: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for ch, resolvers in _Loader.yaml_implicit_resolvers.items()
}


def split_overrides(argv: Sequence[str]) -> list[tuple[str, str]]:
    """Pair up ``--a.b value`` and ``--a.b=value`` tokens; the token after a bare key is its value."""
    pairs: list[tuple[str, str]] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("--") or token == "--":
            raise ConfigError(f"unexpected argument {token!r}: overrides look like --section.key value")
        body = token[2:]
        if "=" in body:
            key, value = body.split("=", 1)
            i += 1
        else:
            key = body
            if i + 1 >= len(argv):
                raise ConfigError(f"--{key} needs a value")
            value = argv[i + 1]
            i += 2
        if not _KEY_RE.match(key):
            raise ConfigError(f"invalid override key {token!r}: expected --section.key")
        pairs.append((key, value))
    return pairs


def parse_value(text: str) -> Any:
    """Read one override value with YAML scalar rules (``null``, ``1e-4``, ``[1, 2]``, ``true``)."""
    if "${" in text or not text.strip():
        return text  # interpolations are resolved by OmegaConf; an empty value is an empty string
    try:
        value = yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader
    except yaml.YAMLError:
        return text
    if value is None and text.strip() not in ("null", "Null", "NULL", "~"):
        return text  # e.g. a value that starts with '#'
    return value


def load_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a recipe file; errors name the file, line and column."""
    return _load_yaml_marked(path)[0]


def _load_yaml_marked(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, int]]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"recipe file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read recipe {path}: {getattr(exc, 'strerror', None) or exc}") from None
    loader = _Loader(text)
    try:
        line = yaml_depth_line(text)
        if line is not None:
            raise ConfigError(f"{path}:{line}: the recipe nests deeper than {MAX_DEPTH} levels")
        node = loader.get_single_node()
        if node is not None:
            _check_aliases(node, path)
        data = loader.construct_document(node) if node is not None else None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise ConfigError(f"{where}: {_one_line(exc.problem or exc.context or 'invalid YAML')}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: {_one_line(str(exc))}") from None
    finally:
        loader.dispose()
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    marks: dict[str, int] = {}
    _collect_marks(node, "", marks)
    return data, marks


ALIAS_BUDGET = 10_000  # values that YAML aliases may add to a recipe once expanded


def _check_aliases(root: yaml.Node, path: str | os.PathLike[str]) -> None:
    """Refuse a document whose aliases expand it by more than ``ALIAS_BUDGET`` values, or refer to themselves:
    nested aliases grow a small file exponentially once expanded. Counted once per node: linear in the file."""
    sizes: dict[int, int] = {}
    open_: set[int] = set()
    distinct = 0

    def size(node: yaml.Node) -> int:
        nonlocal distinct
        known = sizes.get(id(node))
        if known is not None:
            return known
        if id(node) in open_:
            raise ConfigError(f"{path}:{node.start_mark.line + 1}: a YAML alias refers to its own anchor "
                              "(a recursive structure); recipes cannot hold one")
        open_.add(id(node))
        distinct += 1
        children: list[yaml.Node] = []
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        total = 1
        for child in children:
            total += size(child)
            if total - distinct > ALIAS_BUDGET:
                raise ConfigError(f"{path}:{node.start_mark.line + 1}: YAML aliases expand this recipe by more "
                                  f"than {ALIAS_BUDGET} values (anchors nested in anchors); write the values out "
                                  "or use ${...} interpolation")
        open_.discard(id(node))
        sizes[id(node)] = total
        return total

    size(root)


def _collect_marks(node: yaml.Node, prefix: str, marks: dict[str, int]) -> None:
    if not isinstance(node, yaml.MappingNode):
        return
    for key_node, value_node in node.value:
        if isinstance(key_node, yaml.ScalarNode):
            full = _join(prefix, key_node.value)
            marks.setdefault(full, key_node.start_mark.line + 1)
            _collect_marks(value_node, full, marks)


class _Source:
    """Where a value came from, to append to error messages."""

    def __init__(self, path: str | None = None, marks: dict[str, int] | None = None, flag: str | None = None,
                 origin: str | None = None):
        self.path, self.marks, self.flag, self.origin = path, marks or {}, flag, origin

    def fmt(self, full_key: str, msg: str) -> str:
        if self.origin is not None:
            return f"{self.origin}: {msg}"
        if self.flag is not None:
            return f"{msg} (from --{self.flag})"
        key = full_key
        while key and key not in self.marks:
            key = key.rpartition(".")[0]
        return f"{self.path}:{self.marks[key]}: {msg}" if key else f"{self.path}: {msg}"


def load_config(path: str | os.PathLike[str], overrides: Sequence[tuple[str, str]] | Sequence[str],
                schema: type) -> DictConfig:
    """Schema defaults and algorithms' sections, the recipe, then each override; validated and resolved."""
    cfg = OmegaConf.structured(with_sections(schema))
    data, marks = _load_yaml_marked(path)
    source = _Source(str(path), marks)
    for key, value in data.items():
        _merge_key(cfg, "", key, value, source)
    pairs = split_overrides(overrides) if overrides and isinstance(overrides[0], str) else overrides
    for key, text in pairs:  # type: ignore[misc]
        value: Any = parse_value(text)
        node = _node_at(cfg, key)
        if isinstance(value, (bool, int, float)) and node is not None and node._metadata.ref_type is str:
            value = text.strip()  # a str field keeps `no`, `017` or `1.10` as typed
        for part in reversed(key.split(".")[1:]):
            value = {part: value}
        _merge_key(cfg, "", key.split(".")[0], value, _Source(flag=key))
    missing = _missing_keys(cfg, "")
    if missing:
        raise ConfigError(f"missing required key{'s' if len(missing) > 1 else ''} " + ", ".join(map(repr, missing)))
    resolve(cfg)  # surface bad interpolations now, not mid-run
    return cfg


def apply_values(cfg: DictConfig, values: Mapping[str, Any], origin: str) -> DictConfig:
    """A copy of ``cfg`` with ``values`` (dotted key -> value) merged in as overrides are, errors naming ``origin``."""
    out = copy.deepcopy(cfg)
    for key, value in values.items():
        if not isinstance(key, str) or not _KEY_RE.match(key):
            raise ConfigError(f"{origin}: {key!r} is not a dotted recipe key (section.key)")
        for part in reversed(key.split(".")[1:]):
            value = {part: value}
        _merge_key(out, "", key.split(".")[0], value, _Source(origin=origin))
    missing = _missing_keys(out, "")
    if missing:
        raise ConfigError(f"{origin}: missing required key {missing[0]!r}")
    resolve(out)
    return out


def _missing_keys(node: DictConfig | ListConfig, prefix: str) -> list[str]:
    """Dotted keys whose value is ``???``, without resolving interpolations."""
    found: list[str] = []
    items = node.keys() if isinstance(node, DictConfig) else range(len(node))
    for key in items:
        full = f"{prefix}[{key}]" if isinstance(node, ListConfig) else _join(prefix, key)
        child = node._get_node(key)
        if child._is_missing():
            found.append(full)
        elif isinstance(child, (DictConfig, ListConfig)) and not (child._is_none() or child._is_interpolation()):
            found.extend(_missing_keys(child, full))
    return found


def _merge_key(parent: DictConfig, prefix: str, key: Any, value: Any, src: _Source) -> None:
    """Set ``parent[key]`` from YAML/override data: mappings merge key by key, anything else replaces."""
    full = _join(prefix, key)
    exists = key in list(parent.keys())
    if not exists and not _is_open(parent):
        raise ConfigError(src.fmt(full, _unknown_key_msg(parent, prefix, key)))
    if not isinstance(value, Mapping):
        _set(parent, key, value, full, src)
        return
    child = parent._get_node(key) if exists else None
    if isinstance(child, DictConfig) and not child._is_interpolation():
        target = None if child._is_none() or child._is_missing() else child.get("_target_")
        if child._is_none() or child._is_missing() or (
            _is_open(child) and "_target_" in value and value["_target_"] != target
        ):
            _set(parent, key, _empty_section(child._metadata.ref_type), full, src)  # a new _target_ starts afresh
    elif not exists and _is_structured(parent._metadata.element_type):
        _set(parent, key, _empty_section(parent._metadata.element_type), full, src)
    else:
        _set(parent, key, value, full, src)
        return
    section = parent._get_node(key)
    for sub_key, sub_value in value.items():
        _merge_key(section, full, sub_key, sub_value, src)


def _set(parent: DictConfig, key: Any, value: Any, full: str, src: _Source) -> None:
    try:
        if isinstance(key, str):
            escaped = re.sub(r"([\\.\[\]=])", r"\\\1", key)
            OmegaConf.update(parent, escaped, value, merge=False, force_add=_is_open(parent))
        else:
            parent[key] = value
    except ValidationError:
        shown = describe_value(value, full)
        raise ConfigError(src.fmt(full, f"{full}: expected {_expected(parent, key)}, got {shown}")) from None
    except OmegaConfBaseException as exc:
        raise ConfigError(src.fmt(full, f"{full}: {omega_message(exc)}")) from None


def _empty_section(ref_type: Any) -> Any:
    return OmegaConf.structured(ref_type) if _is_structured(ref_type) else {}


def _is_structured(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _is_open(node: DictConfig) -> bool:
    """A section that accepts any key: one typed ``Dict[...]``/``Any``, not a dataclass."""
    return not (_is_structured(node._metadata.object_type) or _is_structured(node._metadata.ref_type))


def _unknown_key_msg(parent: DictConfig, prefix: str, key: Any) -> str:
    full = _join(prefix, key)
    names = [str(k) for k in parent.keys()]
    close = difflib.get_close_matches(str(key), names, n=1)
    if close:
        return f"unknown key '{full}' (did you mean '{_join(prefix, close[0])}'?)"
    root = parent._get_root()
    elsewhere = [k for k in _all_keys(root, "") if k.rpartition(".")[2] == str(key)]
    if elsewhere:
        return f"unknown key '{full}' (did you mean '{elsewhere[0]}'?)"
    where = f" in '{prefix}'" if prefix else ""
    return f"unknown key '{full}'; valid keys{where}: " + ", ".join(_join(prefix, n) for n in names)


def _all_keys(node: DictConfig, prefix: str) -> list[str]:
    keys: list[str] = []
    for k in node.keys():
        full = _join(prefix, k)
        keys.append(full)
        child = node._get_node(k)
        if isinstance(child, DictConfig) and not (child._is_none() or child._is_missing() or child._is_interpolation()):
            keys.extend(_all_keys(child, full))
    return keys


def _expected(parent: DictConfig, key: Any) -> str:
    node = parent._get_node(key) if key in list(parent.keys()) else None
    if node is None:
        return type_name(parent._metadata.element_type)
    name = type_name(node._metadata.ref_type)
    return f"{name} or null" if node._metadata.optional and name != "any" else name


def _join(prefix: str, key: Any) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def omega_message(exc: OmegaConfBaseException) -> str:
    """OmegaConf's message without the ``full_key:``/``object_type=`` lines it appends."""
    return _one_line((str(exc.msg or exc).splitlines() or [""])[0])


def resolve(cfg: DictConfig) -> DictConfig:
    """A copy with every interpolation (``${a.b}``, ``${oc.env:VAR,default}``) replaced by its value."""
    out = copy.deepcopy(cfg)
    try:
        OmegaConf.resolve(out)
    except OmegaConfBaseException as exc:
        key, node = exc.full_key or "?", _node_at(cfg, exc.full_key or "")
        raw = None if node is None else node._value()
        shown = f" {raw!r}" if isinstance(raw, str) else ""
        if isinstance(exc, InterpolationValidationError) and isinstance(exc.parent_node, DictConfig):
            expected = _expected(exc.parent_node, exc.key)
            raise ConfigError(f"{key}: expected {expected}, got {describe_value(exc.value, key)} from{shown}") from None
        reason = re.sub(r"^\w+ raised while resolving interpolation: ", "", omega_message(exc)).strip('"')
        raise ConfigError(f"{key}: cannot resolve{shown}: {reason}") from None
    _escape_literals(out)
    return out


def _node_at(cfg: DictConfig, full_key: str) -> Any:
    """The node at a dotted key, or None (best effort: only used to refine values and messages)."""
    node: Any = cfg
    try:
        for part in re.findall(r"[^.\[\]]+", full_key):
            node = node._get_node(int(part) if isinstance(node, ListConfig) else part)
    except Exception:  # noqa: BLE001
        return None
    return node


def _escape_literals(node: DictConfig | ListConfig) -> None:
    """Keep resolved strings that contain ``${`` literal (OmegaConf would read them as interpolations)."""
    keys = list(node.keys()) if isinstance(node, DictConfig) else range(len(node))
    for key in keys:
        child = node._get_node(key)
        if isinstance(child, (DictConfig, ListConfig)):
            if not child._is_none():
                _escape_literals(child)
        elif isinstance(child._value(), str) and "${" in child._value():
            child._set_value(child._value().replace("${", "\\${"))


def to_yaml(cfg: DictConfig) -> str:
    """The resolved config as YAML, secrets redacted: a checkpoint's ``config.yaml``, ``load_config``'s to read back."""
    data = redacted(OmegaConf.to_container(resolve(cfg), resolve=False, enum_to_str=True))
    if isinstance(data, dict) and data.get("stages") == []:
        del data["stages"]  # a run without stages: its config.yaml as before they existed
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, allow_unicode=True)


def to_yaml_data(data: Any) -> str:
    """Plain recipe data (a ``load_yaml`` mapping, edited) as YAML that ``load_yaml`` reads back equal."""
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, allow_unicode=True)
