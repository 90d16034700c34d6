"""A package's face: the members its table names, each imported from its submodule on first use."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def exports_of(table: dict[str, str]) -> dict[str, tuple[str, str]]:
    """A face's ``_EXPORTS`` (name -> (module, name)) from its table: module -> its names, separated by spaces."""
    return {name: (module, name) for module, names in table.items() for name in names.split()}


def lazy_members(package: str, exports: dict[str, tuple[str, str]], namespace: dict[str, Any]
                 ) -> Callable[[str], Any]:
    """The face ``package``'s ``__getattr__``: each member imported on first use, so a verb imports only that."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, attr = exports[name]
        absolute = module.startswith(".") or module.startswith(f"{package.split('.')[0]}.")
        value = getattr(importlib.import_module(module if absolute else f".{module}", package), attr)
        namespace[name] = value
        return value

    return __getattr__
