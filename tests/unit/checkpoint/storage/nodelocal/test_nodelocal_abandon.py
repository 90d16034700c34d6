"""Node-local: an abandoned local step's cleanup, killed at each of its points, never leaves a step a resume takes."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from automodel_ckpt.ondisk import layout
from automodel_ckpt.ondisk.durable import set_pointer
from automodel_ckpt.checkpoint.storage.nodelocal import abandon
from automodel_ckpt.checkpoint.storage.nodelocal.inventory import choose, scan
from tests.unit.checkpoint.storage.nodelocal.test_nodelocal_inventory import PARTS, write_step

OLD, ABANDONED = "epoch_0_step_4", "epoch_0_step_6"


def _nodes(tmp_path: Path) -> list[Path]:
    """Two nodes' folders as a failed commit leaves them: both hold the older step; node 0 committed the new step
    (and points LATEST at it), node 1's commit failed: its staging folder is still there."""
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for node in nodes:
        write_step(node, OLD, PARTS)
    write_step(nodes[0], ABANDONED, PARTS)
    set_pointer(nodes[0], layout.LATEST, ABANDONED)
    write_step(nodes[1], layout.staging_name(ABANDONED), PARTS)
    return nodes


def _cleanup(nodes: list[Path], at) -> None:
    """The cleanup every node runs (``NodeLocalRunFolder.discard``): phase one on every node, then phase two."""
    for node in nodes:
        abandon.hide(node, ABANDONED, at)
    for node in nodes:
        abandon.clear(node, at)


def _chosen(nodes: list[Path]) -> str | None:
    chosen = choose({r: scan(node) for r, node in enumerate(nodes)})
    return chosen.name if chosen is not None else None


def test_the_step_a_failed_commit_left_on_one_node_is_never_chosen(tmp_path):
    nodes = _nodes(tmp_path)
    skipped: list[str] = []
    chosen = choose({r: scan(node) for r, node in enumerate(nodes)}, skipped)
    assert chosen is not None and chosen.name == OLD  # node 0's copy alone is whole, but node 1 never committed it
    assert skipped == [f"local step {ABANDONED}: not committed on every node (a staging folder of it is left)"]


POINTS = 6  # each node's "hide" and "pointers", then each node's "clear"


@pytest.mark.parametrize("kill_at", range(POINTS + 1))
def test_a_kill_at_any_point_of_the_cleanup_leaves_no_step_a_resume_takes(tmp_path, kill_at):
    """The cleanup runs in a child process SIGKILLed at its ``kill_at``-th point (``POINTS``: not killed)."""
    nodes = _nodes(tmp_path)
    seen: list[str] = []

    def at(point: str) -> None:
        seen.append(point)
        if len(seen) - 1 == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    pid = os.fork()
    if pid == 0:  # the child: the cleanup, killed where asked
        try:
            _cleanup(nodes, at)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert killed == (kill_at < POINTS)
    assert _chosen(nodes) == OLD
    if not killed:
        assert [sorted(os.listdir(node)) for node in nodes] == [[OLD], [OLD]]  # LATEST named it: removed too
    _cleanup(nodes, None)  # the next cleanup finishes what a killed one left
    assert [sorted(os.listdir(node)) for node in nodes] == [[OLD], [OLD]]


def test_a_removed_folder_has_nothing_to_clean(tmp_path):
    assert abandon.hide(tmp_path / "gone", ABANDONED) == [] and abandon.clear(tmp_path / "gone") == []


def test_a_hidden_copy_left_by_an_earlier_cleanup_does_not_keep_the_step_committed(tmp_path):
    nodes = _nodes(tmp_path)
    write_step(nodes[0], layout.deleting_name(ABANDONED), PARTS)  # an earlier cleanup of this name, killed
    assert abandon.hide(nodes[0], ABANDONED) == []
    assert not (nodes[0] / ABANDONED).exists()
