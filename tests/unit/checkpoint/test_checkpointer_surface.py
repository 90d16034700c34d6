"""The checkpointer's surface: the four calls, the direct save, wait and load that tools make, and one read-only stats
object; the save cycle decides and never calls back into the checkpointer."""

from __future__ import annotations

import ast
import inspect

from automodel_ckpt.checkpoint import checkpointer as checkpointer_module
from automodel_ckpt.checkpoint import cycle
from automodel_ckpt.checkpoint.checkpointer import Checkpointer, CheckpointerStats

PUBLIC = {"resume", "step_end", "fence", "finalize", "save", "wait", "load", "stats"}


def _public_members(cls: type) -> set[str]:
    """Public methods and properties of ``cls`` and the public attributes its ``__init__`` assigns."""
    names = {name for name in vars(cls) if not name.startswith("_")}
    init = ast.parse(inspect.getsource(cls.__init__).strip().replace("\n    ", "\n"))
    for node in ast.walk(init):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                isinstance(node.value, ast.Name) and node.value.id == "self" and not node.attr.startswith("_"):
            names.add(node.attr)
    return names


def test_the_checkpointer_has_at_most_eight_public_members():
    assert _public_members(Checkpointer) == PUBLIC
    assert len(PUBLIC) <= 8


def test_the_stats_are_read_only():
    for name, member in vars(CheckpointerStats).items():
        if not name.startswith("_"):
            assert isinstance(member, property) and member.fset is None, name


def test_the_save_cycle_decides_without_the_checkpointer():
    names = {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(ast.parse(inspect.getsource(cycle)))
             if isinstance(n, (ast.Name, ast.Attribute))}
    assert not {"Checkpointer", "checkpointer", "saves", "save", "save_local"} & names
    assert "SaveCycle(self" not in inspect.getsource(checkpointer_module)
    assert set(inspect.signature(cycle.SaveCycle).parameters) == {"every_minutes", "preemption", "enabled",
                                                                   "local_due", "interval"}
