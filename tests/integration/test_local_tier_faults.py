"""The node-local tier loses a step, never the run: a local folder filled by another job (a real tmpfs) makes its
step abandoned on every rank with one warning, training goes on with the losses of a run without the tier, the
durable checkpoints are all written, and the tier says once when its steps are written again. On two nodes, a
resume after a kill never takes a step that was abandoned or is missing a copy."""

from __future__ import annotations

from pathlib import Path

import pytest

from automodel_ckpt.ondisk import catalog
from automodel_ckpt.checkpoint.storage.nodelocal.inventory import choose, scan
from tests.integration.harness import REPO, ckpt_train
from tests.integration.shared_runs import STRAIGHT_KEYS, STRAIGHT_STEPS
from tests.integration.test_disk_full import mounted
from tests.integration.test_fast_recovery import ARGS, RECIPES, _records, _same_losses, _starts, _two_nodes

EVERY_STEP = ("--checkpoint.local.every_steps", "1")  # local steps 1, 2, 3, 5, 6, 7; durable 4 and 8
FAULTS = f"{RECIPES}.LocalFolderFaultsRecipe"
ROOM = 32 << 20  # two local steps of the tiny model with a copy each, and some room to spare


@pytest.fixture
def tmpfs(tmp_path: Path):
    with mounted(tmp_path / "tmpfs", ROOM) as mnt:
        yield mnt


def _lines(out: str, words: str) -> list[str]:
    return [line for line in out.splitlines() if words in line]


def test_a_full_local_folder_costs_one_local_step_not_the_run(tmp_path, tmpfs, assets, straight_runs):
    """Filled just before the local step 6, given room back before the local step 7."""
    listing = tmp_path / "listing"
    done = ckpt_train(tmp_path, assets, *STRAIGHT_KEYS, "--step_scheduler.max_steps", str(STRAIGHT_STEPS),
                      *EVERY_STEP, "--recipe", FAULTS, "--checkpoint.checkpoint_dir", "run",
                      "--checkpoint.local.dir", str(tmpfs / "loc"), nproc=1,
                      env={"PYTHONPATH": str(REPO), "FILLER": str(tmpfs / "filler"), "FAULT": "fill",
                           "FAULT_AT_LOCAL_STEP": "6", "MEND_AT_LOCAL_STEP": "7",
                           "LOCAL_LISTING": str(listing)})
    out = done.output
    abandoned = _lines(out, "abandoned:")  # the warning (the end-of-run line counts them: "1 local step(s) abandoned")
    assert len(abandoned) == 1, out[-3000:]
    assert len(_lines(out, "; 1 local step(s) abandoned")) == 1
    assert abandoned[0].startswith(f"warning: node-local step epoch_0_step_6 abandoned: no space left on device in "
                                   f"'{tmpfs / 'loc'}' (needs about ")
    assert "free there)" in abandoned[0] and "the next due node-local step is tried" in abandoned[0]
    assert _lines(out, "node-local steps are written again") == [
        "node-local steps are written again: epoch_0_step_7 (after 1 failed in a row)"]
    assert "error" not in out.lower() and "Traceback" not in out
    assert [r.name for r in catalog.scan_checkpoints(tmp_path / "run")] == ["epoch_0_step_4", "epoch_0_step_8"]
    _same_losses(tmp_path / "run", _records(straight_runs.get(1)), 1)  # as without the tier, bitwise
    seen = dict(line.split(": ", 1) for line in listing.read_text().splitlines())
    assert "epoch_0_step_5" in seen["6"].split()  # the step before the filling is kept
    assert not any("step_6" in name for name in seen["7"].split())  # the abandoned step left nothing
    assert not (tmpfs / "loc").exists()  # the finished run removed its folder


def _one_process(tmp_path: Path, tmpfs: Path, assets: Path, **env: str) -> str:
    """The straight run on one process with a local step after every step and ``env``'s fault; its output."""
    return ckpt_train(tmp_path, assets, *STRAIGHT_KEYS, "--step_scheduler.max_steps", str(STRAIGHT_STEPS),
                      *EVERY_STEP, "--recipe", FAULTS, "--checkpoint.checkpoint_dir", "run",
                      "--checkpoint.local.dir", str(tmpfs / "loc"), nproc=1,
                      env={"PYTHONPATH": str(REPO), "MOUNT": str(tmpfs), **env}).output


def test_a_read_only_local_filesystem_costs_one_local_step(tmp_path, tmpfs, assets, straight_runs):
    out = _one_process(tmp_path, tmpfs, assets, FAULT="readonly", FAULT_AT_LOCAL_STEP="6", MEND_AT_LOCAL_STEP="7")
    abandoned = _lines(out, "abandoned:")
    assert len(abandoned) == 1 and abandoned[0].startswith(
        "warning: node-local step epoch_0_step_6 abandoned: the filesystem is read-only ("), out[-3000:]
    assert len(_lines(out, "node-local steps are written again: epoch_0_step_7")) == 1
    assert [r.name for r in catalog.scan_checkpoints(tmp_path / "run")] == ["epoch_0_step_4", "epoch_0_step_8"]
    _same_losses(tmp_path / "run", _records(straight_runs.get(1)), 1)


def test_a_removed_local_folder_is_made_again(tmp_path, tmpfs, assets):
    listing = tmp_path / "listing"
    out = _one_process(tmp_path, tmpfs, assets, FAULT="remove", FAULT_AT_LOCAL_STEP="6",
                       LOCAL_LISTING=str(listing))
    assert _lines(out, "node-local folder") == [f"warning: the node-local folder '{tmpfs / 'loc'}' was removed; "
                                                "made again"]
    assert not _lines(out, "abandoned:")
    seen = dict(line.split(": ", 1) for line in listing.read_text().splitlines())
    assert "epoch_0_step_6" in seen["7"].split()  # written into the folder made again
    assert [r.name for r in catalog.scan_checkpoints(tmp_path / "run")] == ["epoch_0_step_4", "epoch_0_step_8"]


def test_a_peer_that_cannot_write_its_copy_costs_one_local_step(tmp_path, tmpfs, assets, straight_runs):
    """Node 1 keeps room for its own part of the local step 6 but not for node 0's copy: no node commits it."""
    dirs = [tmp_path / "node0", tmpfs / "node1"]
    listing = tmp_path / "listing"
    out = _two_nodes(tmp_path, assets, *EVERY_STEP, "--recipe", FAULTS, dirs=dirs,
                     env={"FILLER": str(tmpfs / "filler"), "FAULT": "fill", "FAULT_RANKS": "1",
                          "FILL_LEAVE_BYTES": str(5 << 20), "FAULT_AT_LOCAL_STEP": "6", "MEND_AT_LOCAL_STEP": "7",
                          "LOCAL_LISTING": str(listing)})
    abandoned = _lines(out, "abandoned:")
    assert len(abandoned) == 1 and f"no space left on device in '{dirs[1]}'" in abandoned[0] \
        and "while copying 'epoch_0_step_6' to other nodes" in abandoned[0], out[-3000:]
    assert len(_lines(out, "node-local steps are written again: epoch_0_step_7")) == 1
    seen = dict(line.split(": ", 1) for line in listing.read_text().splitlines())
    assert not any("step_6" in name for name in seen["7"].split())  # node 0 committed nothing of it
    _same_losses(tmp_path / "run", _records(straight_runs.get(2)), 1)


def test_a_peer_folder_full_two_nodes_resume_from_a_complete_step(tmp_path, tmpfs, assets, straight_runs):
    """Node 1's folder is filled before the local step 6 and stays full: steps 6 and 7 are abandoned, nothing of
    them is committed anywhere; killed after step 7, the rerun resumes from the local step 5 (whole on both
    nodes) bitwise, and finishes with node 1 still full."""
    dirs = [tmp_path / "node0", tmpfs / "node1"]
    env = {"FILLER": str(tmpfs / "filler"), "FAULT": "fill", "FAULT_RANKS": "1", "FAULT_AT_LOCAL_STEP": "6"}
    out = _two_nodes(tmp_path, assets, *EVERY_STEP, "--recipe", FAULTS, env={**env, "DIE_AFTER_LOCAL_STEP": "7"},
                     expect_ok=False, dirs=dirs)
    abandoned = _lines(out, "abandoned:")
    assert len(abandoned) == 1 and "node-local step epoch_0_step_6 abandoned: no space left on device in " \
        f"'{dirs[1]}'" in abandoned[0], out[-3000:]
    inventories = {r: scan(folder) for r, folder in enumerate(dirs)}
    assert [sorted(inv.steps) for inv in inventories.values()] == [["epoch_0_step_5"], ["epoch_0_step_5"]]
    assert choose(inventories).name == "epoch_0_step_5"
    assert [r.name for r in catalog.scan_checkpoints(tmp_path / "run")] == ["epoch_0_step_4"]

    out = _two_nodes(tmp_path, assets, *EVERY_STEP, env={"FILLER": str(tmpfs / "filler")}, dirs=dirs)
    start = _starts(tmp_path / "run")[-1]
    assert (start["tier"], start["resumed_from"]) == ("local", "epoch_0_step_5")
    again = _lines(out, "abandoned:")  # steps 6 and 7 again: node 1 is still full, found by the space check
    assert len(again) == 2 and all("checking the node-local folder's room failed on rank 1" in line for line in again)
    assert "the next due node-local step is skipped" in again[1]  # the second failure in a row: one skipped
    _same_losses(tmp_path / "run", _records(straight_runs.get(2)), 6)
    assert [r.name for r in catalog.scan_checkpoints(tmp_path / "run")] == ["epoch_0_step_4", "epoch_0_step_8"]
