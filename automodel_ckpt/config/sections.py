"""The algorithms' recipe sections: each algorithm registers its section (name, dataclass, checks, preview) here."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from automodel_ckpt.errors import ConfigError

AFTER = "peft"  # a recipe's algorithm sections follow this key, in the order they were registered


@dataclasses.dataclass(frozen=True)
class AlgorithmSection:
    """An algorithm's ``NAME:`` section of a recipe, given when a run trains with that algorithm."""

    name: str  # the recipe key (``dpo``)
    config: type  # its dataclass: keys, types and defaults (importing no torch: the launcher reads it)
    meaning: str  # its line in the config reference
    check: Optional[Callable[[Any, Any], None]] = None  # (cfg, mesh sizes): raise ConfigError before training
    preview: Optional[Callable[..., None]] = None  # (cfg, tokenizer, num=, split=, color=): ``preview``'s rows
    no_stages: Optional[str] = None  # why a run with this section takes no ``stages:`` (None: it takes them)


_SECTIONS: dict[str, AlgorithmSection] = {}
_SCHEMAS: dict[tuple, type] = {}


def register_section(section: AlgorithmSection) -> None:
    """Every recipe loaded from now on takes ``section``; a name is registered once."""
    if _SECTIONS.setdefault(section.name, section) != section:
        raise ConfigError(f"recipe section {section.name!r} is registered twice")


def unregister_section(name: str) -> None:
    """Recipes loaded from now on no longer take ``name:`` (a test's toy section)."""
    _SECTIONS.pop(name, None)


def registered() -> list[AlgorithmSection]:
    return list(_SECTIONS.values())


def present(cfg: Any) -> list[AlgorithmSection]:
    """The registered sections a loaded recipe gives."""
    return [s for s in _SECTIONS.values() if cfg.get(s.name) is not None]


def with_sections(schema: type) -> type:
    """``schema`` with an optional field per registered section after ``AFTER`` (unchanged without that key)."""
    key = (schema, tuple(_SECTIONS.values()))
    if key not in _SCHEMAS:
        fields: list[tuple] = []
        for f in dataclasses.fields(schema):
            fields.append((f.name, f.type, dataclasses.field(default=f.default, default_factory=f.default_factory)))
            if f.name == AFTER:
                fields += [(s.name, Optional[s.config], dataclasses.field(default=None)) for s in _SECTIONS.values()]
        made = dataclasses.make_dataclass(schema.__name__, fields, namespace={"__doc__": schema.__doc__})
        made.__module__ = schema.__module__  # its other fields' annotations are names of that module
        _SCHEMAS[key] = made if len(fields) > len(dataclasses.fields(schema)) else schema
    return _SCHEMAS[key]
