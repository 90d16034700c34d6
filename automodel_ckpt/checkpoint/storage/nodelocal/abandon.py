"""Removing an abandoned local step from the node-local folders so that no resume selects it, wherever a kill stops it.

Two collective phases: every node ``hide``s its committed copy (one rename) before any ``clear``s its staging
folders, and a resume never takes a step some node still stages.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from automodel_ckpt.ondisk import layout
from automodel_ckpt.ondisk.durable import read_pointer, remove_pointer, remove_tree
from automodel_ckpt.errors import first_line

Hook = Callable[[str], None]


def hide(folder: Path, name: str, at: Hook | None = None) -> list[str]:
    """Phase one: ``name``'s committed copy renamed out of sight and its pointers removed; one line per failure,
    never raises. ``at`` (a test's stop) is called with ``"hide"`` and ``"pointers"``."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    problems: list[str] = []
    _at(at, "hide")
    committed = folder / name
    try:
        if os.path.islink(committed):
            os.unlink(committed)
        elif os.path.lexists(committed):
            remove_tree(folder / layout.deleting_name(name))  # left by an earlier cleanup a kill stopped
            os.replace(committed, folder / layout.deleting_name(name))
    except OSError as exc:
        problems.append(f"cannot hide '{committed}': {first_line(exc)}")
    _at(at, "pointers")
    for pointer in layout.POINTERS:
        try:
            if read_pointer(folder, pointer) == name:
                remove_pointer(folder, pointer)
        except OSError as exc:
            problems.append(f"cannot remove '{folder / pointer}': {first_line(exc)}")
    return problems


def clear(folder: Path, at: Hook | None = None) -> list[str]:
    """Phase two: the staging and hidden folders in ``folder`` removed, following no link; one line per folder left,
    never raises. ``at`` is called with ``"clear"`` first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    _at(at, "clear")
    try:
        entries = sorted(os.listdir(folder))
    except OSError as exc:
        return [f"cannot list '{folder}': {first_line(exc)}"]
    problems = []
    for entry in entries:
        if layout.is_staging(entry) or entry.startswith(layout.DELETING_PREFIX):
            remove_tree(folder / entry)  # never raises: what it could not remove is still there
            if os.path.lexists(folder / entry):
                problems.append(f"cannot remove '{folder / entry}'")
    return problems


def _at(hook: Hook | None, point: str) -> None:
    if hook is not None:
        hook(point)
