"""Removing an abandoned local step from the node-local folders so that no resume selects it, wherever a kill stops it.

A local step that failed somewhere is abandoned on every node. What a node's folder may hold of it: its staging
folder, and, where the commit went through on this node but failed on another, the committed step itself. A resume
never takes a step that any node still holds a staging folder of (``inventory.choose``), so the cleanup runs in two
collective phases: first every node ``hide``s its committed copy (one rename to ``.deleting-<name>``: atomic) and
drops the pointer naming it; only once every node has, every node ``clear``s its staging and hidden folders. A kill
at any point leaves either a staging folder of the step somewhere (the step is passed over) or no committed copy.
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
    """Phase one: the committed copy of ``name`` in ``folder``, if any, renamed out of every resume's sight, and the
    pointers naming it removed. One line per thing that failed; never raises. ``at`` is called with ``"hide"`` and
    ``"pointers"`` before each part (a test stops it there)."""
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
    """Phase two: the staging and hidden folders in ``folder`` removed (nothing is being written when it runs),
    following no link. One line per folder left; never raises. ``at`` is called with ``"clear"`` first."""
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
