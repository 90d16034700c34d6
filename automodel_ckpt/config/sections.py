"""The algorithms' recipe sections: each algorithm registers its section (name, dataclass, checks, preview) here."""

from __future__ import annotations

import copyreg
import dataclasses
import types
from typing import Any, Callable, Optional

from automodel_ckpt.errors import ConfigError
from automodel_ckpt.registry import Registry

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


_SECTIONS: Registry[AlgorithmSection] = Registry("a recipe section", lambda name, names: ConfigError(
    f"no recipe section {name!r}; the sections are {', '.join(names)}"))
unregister_section = _SECTIONS.unregister  # recipes loaded from now on no longer take ``name:`` (a toy section)
_SCHEMAS: dict[tuple, type] = {}


def register_section(section: AlgorithmSection) -> None:
    """Every recipe loaded from now on takes ``section``; a name is registered once."""
    if _SECTIONS.first(lambda s: s.name == section.name) not in (None, section):
        raise ConfigError(f"recipe section {section.name!r} is registered twice")
    _SECTIONS.register(section)


def registered() -> list[AlgorithmSection]:
    return list(_SECTIONS)


def present(cfg: Any) -> list[AlgorithmSection]:
    """The registered sections a loaded recipe gives."""
    return [s for s in _SECTIONS if cfg.get(s.name) is not None]


class _WithSections(type):
    """The type of a schema with sections: pickled as ``with_sections(base)``, made again where it is read."""


def with_sections(schema: type) -> type:
    """``schema`` with an optional field per registered section after ``AFTER`` (unchanged without that key)."""
    key = (schema, tuple(_SECTIONS))
    if key not in _SCHEMAS:
        fields: dict[str, Any] = {}
        for f in dataclasses.fields(schema):
            fields[f.name] = (f.type, dataclasses.field(default=f.default, default_factory=f.default_factory))
            if f.name == AFTER:
                fields.update({s.name: (Optional[s.config], dataclasses.field(default=None)) for s in registered()})
        body = {"__annotations__": {k: t for k, (t, _) in fields.items()}, **{k: d for k, (_, d) in fields.items()},
                "__doc__": schema.__doc__, "_base": schema,
                "__module__": schema.__module__}  # the base's annotations are names of its module
        made = types.new_class(schema.__name__, (), {"metaclass": _WithSections}, lambda ns: ns.update(body))
        _SCHEMAS[key] = dataclasses.dataclass(made) if len(fields) > len(dataclasses.fields(schema)) else schema
    return _SCHEMAS[key]


copyreg.pickle(_WithSections, lambda made: (with_sections, (made._base,)))
