"""Byte counts as people read them: one format for every message and verb."""

from __future__ import annotations


def human_size(size: int) -> str:
    """Bytes in binary units: ``1023 B``, ``1.5 KiB``, ``5.0 GiB``."""
    value, units = float(size), ("B", "KiB", "MiB", "GiB", "TiB")
    for unit in units[:-1]:
        if value < 1024:
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} {units[-1]}"
