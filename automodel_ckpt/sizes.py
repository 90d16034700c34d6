"""Sizes: byte counts as people read them (one format for every message and verb), and items cut by size."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")


def human_size(size: int) -> str:
    """Bytes in binary units: ``1023 B``, ``1.5 KiB``, ``5.0 GiB``."""
    value, units = float(size), ("B", "KiB", "MiB", "GiB", "TiB")
    for unit in units[:-1]:
        if value < 1024:
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} {units[-1]}"


def in_groups(items: Iterable[T], size: Callable[[T], int], limit: int) -> list[list[T]]:
    """``items`` in order, in groups of at most ``limit`` in total ``size`` (an item over ``limit`` stands alone)."""
    groups: list[list[T]] = []
    used = 0
    for item in items:
        n = size(item)
        if not groups or used + n > limit:
            groups.append([])
            used = 0
        groups[-1].append(item)
        used += n
    return groups
