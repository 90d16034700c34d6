"""A package's face: the members its table names, each imported from its submodule on first use."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def exports_of(table: dict[str, str]) -> dict[str, tuple[str, str]]:
    """A face's ``_EXPORTS``, name -> (module, the same name there), from its table: module -> the names of its
    members the face hands on, separated by spaces (a member keeps its name on the way out)."""
    return {name: (module, name) for module, names in table.items() for name in names.split()}


def lazy_members(package: str, exports: dict[str, tuple[str, str]], namespace: dict[str, Any]
                 ) -> Callable[[str], Any]:
    """The ``__getattr__`` of the face ``package``: ``exports`` maps a name to (module, its name there), the module
    a submodule's bare name, a relative one (``.storage``) or an absolute one. A member is imported when first
    asked for and kept in the face's ``namespace``, so a verb that reads a run folder imports only what it uses
    (no torch)."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, attr = exports[name]
        absolute = module.startswith(".") or module.startswith(f"{package.split('.')[0]}.")
        value = getattr(importlib.import_module(module if absolute else f".{module}", package), attr)
        namespace[name] = value
        return value

    return __getattr__
