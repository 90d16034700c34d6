"""Plug-ins by name (model formats, export targets, import sources, recipe sections): one registry class for all."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Plug-ins by their ``name``, in registration order; ``get`` raises ``missing(name, names)`` for an unknown one."""

    def __init__(self, what: str, missing: Callable[[Any, list[str]], Exception]) -> None:
        self.what, self._missing = what, missing
        self._items: dict[str, T] = {}

    def register(self, item: T) -> T:
        """Add ``item`` (its ``name`` a string); registering a name again replaces it."""
        name = getattr(item, "name", None)
        if not name or not isinstance(name, str) or name.startswith("-"):
            raise ValueError(f"{self.what} needs a name, got {item!r}")
        self._items[name] = item
        return item

    def unregister(self, name: str) -> None:
        """Remove ``name`` (a plug-in's, when it is done)."""
        self._items.pop(str(name), None)

    def names(self) -> list[str]:
        return list(self._items)

    def __iter__(self) -> Iterator[T]:
        return iter(list(self._items.values()))

    def get(self, name: Any) -> T:
        """The one named ``name`` (a string, or a value whose ``str`` is one); ``missing``'s error otherwise."""
        item = self._items.get(str(name))
        if item is None:
            raise self._missing(name, self.names())
        return item

    def first(self, test: Callable[[T], Any]) -> T | None:
        """The first registered that ``test`` takes; None when none does."""
        return next((item for item in self._items.values() if test(item)), None)
