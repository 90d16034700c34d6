"""Removing an abandoned local step from one node's folder so that no resume selects it, wherever a kill stops it.

A local step that failed somewhere is abandoned on every node. What a node's folder may hold of it: its staging
folder (never selected: ``inventory.scan`` passes over staging folders) and, when the commit went through here but
failed on another node, the committed step itself (which ``scan`` would offer). The committed copy is hidden first,
by one rename to ``.deleting-<name>`` (atomic: a kill before it leaves the step as committed, a kill after it leaves a
folder no resume looks at), then the pointer naming it is dropped, then the hidden and staging folders are removed;
what a kill leaves of them is removed by the next cleanup, reserve or prune.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from automodel_ckpt.checkpoint.disk import layout
from automodel_ckpt.checkpoint.disk.durable import read_pointer, remove_pointer, remove_tree
from automodel_ckpt.errors import first_line

#: the points of ``discard``, in order; its ``at`` hook is called with each before that part is done
POINTS = ("hide", "pointers", "remove")


def discard(folder: Path, name: str, at: Callable[[str], None] | None = None) -> list[str]:
    """Remove what ``folder`` holds of the abandoned local step ``name`` (and leftovers of unfinished steps); one
    line per thing that could not be removed (a missing folder holds nothing: no line). Never raises for the
    folder's own failures. ``at``: called with each of ``POINTS`` before that part (a test stops it there)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    problems: list[str] = []
    _at(at, "hide")
    committed = folder / name
    if os.path.lexists(committed):
        try:
            os.replace(committed, folder / layout.deleting_name(name)) if not os.path.islink(committed) \
                else os.unlink(committed)
        except OSError as exc:
            problems.append(f"cannot hide '{committed}': {first_line(exc)}")
    _at(at, "pointers")
    for pointer in layout.POINTERS:
        try:
            if read_pointer(folder, pointer) == name:
                remove_pointer(folder, pointer)
        except OSError as exc:
            problems.append(f"cannot remove '{folder / pointer}': {first_line(exc)}")
    _at(at, "remove")
    try:
        entries = sorted(os.listdir(folder))
    except OSError as exc:
        return problems + [f"cannot list '{folder}': {first_line(exc)}"]
    for entry in entries:
        if layout.is_staging(entry) or entry.startswith(layout.DELETING_PREFIX):
            remove_tree(folder / entry)  # never raises; what it could not remove is still there
            if os.path.lexists(folder / entry):
                problems.append(f"cannot remove '{folder / entry}'")
    return problems


def _at(hook: Callable[[str], None] | None, point: str) -> None:
    if hook is not None:
        hook(point)
