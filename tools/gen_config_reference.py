"""Writes docs/config-reference.md from the config schema: python tools/gen_config_reference.py

Each key's meaning is the comment on its line in the schema, so the reference cannot drift from the code;
a test regenerates it and compares.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from pathlib import Path
from typing import Any

import automodel_ckpt.algorithms  # noqa: F401 - registers the algorithms' sections, which the reference lists
from automodel_ckpt.config.instantiate import locate
from automodel_ckpt.config.schema import RecipeConfig
from automodel_ckpt.config.sections import registered, with_sections

_FIELD_COMMENT = re.compile(r"^\s*(\w+)\s*:[^#]*#\s*(.+?)\s*$")
# Arguments the recipe passes itself; they are not config keys.
_SUPPLIED_BY_RECIPE = {"params", "optimizer", "total_steps", "self", "on_meta"}


def _comments(cls: type) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in inspect.getsource(cls).splitlines():
        m = _FIELD_COMMENT.match(line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        return f"{_type_name(inner[0])} \\| null" if len(inner) == 1 else " \\| ".join(map(_type_name, args))
    if origin in (list, typing.List):
        return f"list[{_type_name(args[0])}]" if args else "list"
    if origin in (dict, typing.Dict):
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _unwrap_optional(tp: Any) -> Any:
    args = typing.get_args(tp)
    if typing.get_origin(tp) is typing.Union and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        return inner[0] if len(inner) == 1 else tp
    return tp


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return "(required)"


def _fmt(value: Any) -> str:
    if dataclasses.is_dataclass(value):
        return "(its keys below)"
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f"`{value}`" if value else '`""`'
    return f"`{value}`"


def _target_rows(section: str, defaults: dict[str, Any]) -> list[str]:
    """Rows for an open `_target_` section: its default target and that target's keyword arguments."""
    rows = [f"| `{section}._target_` | str | {_fmt(defaults.get('_target_'))} | what to build (dotted path or file.py:Name) |"]
    try:
        target = locate(defaults["_target_"])
        params = inspect.signature(target).parameters.values()
    except Exception:  # noqa: BLE001 - a target without an inspectable signature lists only its defaults
        params = []
    seen = set()
    for p in params:
        if p.name in _SUPPLIED_BY_RECIPE or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        seen.add(p.name)
        value = defaults.get(p.name, p.default if p.default is not inspect.Parameter.empty else "(required)")
        rows.append(f"| `{section}.{p.name}` | {_annotation(p)} | {_fmt(value)} | argument of the target |")
    for key, value in defaults.items():
        if key != "_target_" and key not in seen:
            rows.append(f"| `{section}.{key}` | | {_fmt(value)} | argument of the target |")
    return rows + _RECIPE_ROWS.get(section, [])


#: Keys of a ``_target_`` section the recipe reads itself (``instantiate.RECIPE_KEYS``), never the target's.
_RECIPE_ROWS = {"model": [
    "| `model.freeze` | list[str] \\| None | `null` | parameters that do not train (no gradients, no optimizer state): "
    "names, globs, module names, or the groups `vision_tower`, `embeddings`, `lm_head`, `language_model` "
    "([vlm](vlm.md#freezing-parts-of-the-model)) |"]}


def _annotation(p: inspect.Parameter) -> str:
    ann = p.annotation
    if ann is inspect.Parameter.empty:
        return ""
    return (ann if isinstance(ann, str) else _type_name(ann)).replace("|", "\\|")


def render_reference() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Every key of a recipe, its type, default and meaning. Generated from the schema in `automodel_ckpt/config/`",
        "by `python tools/gen_config_reference.py`; a test keeps this page in sync. Override any key on the command",
        "line: `--section.key value` or `--section.key=value` (values use YAML rules: `null`, `1e-4`, `[1,2]`, `true`).",
        "Sections with `_target_` build an object: their other keys are the target's keyword arguments and are",
        "checked against its signature when it is built.",
        "",
    ]
    schema = with_sections(RecipeConfig)  # the algorithms' sections: those registered (``config.sections``)
    hints = typing.get_type_hints(schema)
    comments = {**_comments(RecipeConfig), **{s.name: s.meaning for s in registered()}}
    top_rows = []
    sections = []
    for f in dataclasses.fields(schema):
        tp = _unwrap_optional(hints[f.name])
        if dataclasses.is_dataclass(tp):
            sections.append((f.name, tp, comments.get(f.name, ""), _default(f) is None))
        elif typing.get_origin(tp) in (dict, typing.Dict):
            sections.append((f.name, _default(f), comments.get(f.name, ""), _default(f) is None))
        else:
            top_rows.append(f"| `{f.name}` | {_type_name(hints[f.name])} | {_fmt(_default(f))} | {comments.get(f.name, '')} |")
    lines += ["## Top level", "", "| Key | Type | Default | Meaning |", "|---|---|---|---|", *top_rows, ""]
    for name, spec, comment, optional in sections:
        lines += [f"## `{name}`", ""]
        if comment:
            lines += [comment[0].upper() + comment[1:] + ".", ""]
        if optional:
            lines += ["Absent (`null`) by default; giving any key enables the section.", ""]
        lines += ["| Key | Type | Default | Meaning |", "|---|---|---|---|"]
        if dataclasses.is_dataclass(spec):
            doc = spec.__doc__ or ""
            if doc and not comment and not doc.startswith(spec.__name__ + "("):
                lines[-3:-3] = [doc.splitlines()[0], ""]
            sub_hints = typing.get_type_hints(spec)
            sub_comments = _comments(spec)
            for f in dataclasses.fields(spec):
                lines.append(f"| `{name}.{f.name}` | {_type_name(sub_hints[f.name])} | {_fmt(_default(f))} | "
                             f"{sub_comments.get(f.name, '')} |")
                nested = _unwrap_optional(sub_hints[f.name])
                if dataclasses.is_dataclass(nested):  # a subsection: its keys too
                    nested_hints, nested_comments = typing.get_type_hints(nested), _comments(nested)
                    lines += [f"| `{name}.{f.name}.{g.name}` | {_type_name(nested_hints[g.name])} | "
                              f"{_fmt(_default(g))} | {nested_comments.get(g.name, '')} |" for g in dataclasses.fields(nested)]
        elif isinstance(spec, dict) and "_target_" in spec:
            lines += _target_rows(name, spec)
        else:
            lines.append(f"| `{name}._target_` | str | `null` | what to build; other keys are its arguments |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    out = Path(__file__).resolve().parents[1] / "docs" / "config-reference.md"
    out.write_text(render_reference(), encoding="utf-8")
    print(f"wrote {out}")
