"""The node-local tier: two nodes (one process each, on this machine) with their own local folders, killed after a
local step newer than the durable one; one killed state is resumed in several ways (a node lost, one process, the
local step damaged everywhere); and torch's agent restarting workers in place.

Every run is world size 2 except the reshard, so the session's straight run on two processes is the reference.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from automodel_ckpt.ondisk import layout
from tests.integration.harness import CKPT_TRAIN, QUIET, RECIPE, REPO, ckpt_train, env_for, free_port, jsonl, \
    start_command
from tests.integration.shared_runs import STRAIGHT_KEYS, STRAIGHT_STEPS

ARGS = (*STRAIGHT_KEYS, "--step_scheduler.max_steps", str(STRAIGHT_STEPS), "--checkpoint.local.every_steps", "2")
RECIPES = "tests.integration.fast_recovery_recipes"


def _records(run_dir):
    return {r["step"]: r for r in jsonl(run_dir / "training.jsonl")}


def _starts(run_dir):
    return [e for e in jsonl(run_dir / layout.EVENTS_LOG) if e["event"] == "start"]


def _two_nodes(cwd, assets, *args, env=None, expect_ok=True, dirs=None):
    """Both nodes' ``ckpt-train``, each with its node-local folder (``dirs``, default ``cwd/node0``, ``cwd/node1``);
    node 0's output."""
    dirs = dirs or [cwd / f"node{r}" for r in (0, 1)]
    port = str(free_port())
    procs = [
        start_command([CKPT_TRAIN, "--nnodes", "2", "--node-rank", str(r), "--nproc-per-node", "1",
                       "--master-addr", "127.0.0.1", "--master-port", port, str(RECIPE), *QUIET, *ARGS, *args,
                       "--checkpoint.checkpoint_dir", "run", "--checkpoint.local.dir", str(dirs[r])],
                      cwd=cwd, env=env_for(assets, {"PYTHONPATH": str(REPO), **(env or {})}), stdout=subprocess.PIPE,
                      stderr=subprocess.STDOUT, text=True)
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    codes = [p.returncode for p in procs]
    if expect_ok:
        assert codes == [0, 0], outs[0][-3000:] + outs[1][-2000:]
    else:
        assert all(c != 0 for c in codes), outs[0][-2000:]
    return outs[0]


@pytest.fixture(scope="module")
def straight(straight_runs):
    """Eight steps on two processes, uninterrupted (the session's shared run: the node-local tier changes no
    loss): the losses and samples every resume must give."""
    return _records(straight_runs.get(2))


@pytest.fixture(scope="module")
def killed_state(tmp_path_factory, assets):
    """Both nodes killed right after the local step 6 is committed everywhere (the durable tier has step 4); the
    folders as they were left are kept aside, each test starts from them in the same place (the node-local
    folders are bound to the run folder's path)."""
    cwd = tmp_path_factory.mktemp("killed")
    _two_nodes(cwd, assets, "--recipe", f"{RECIPES}.DieAfterLocalStepRecipe", env={"DIE_AFTER_LOCAL_STEP": "6"},
               expect_ok=False)
    for node in ("node0", "node1"):
        assert (cwd / node / "epoch_0_step_6" / layout.MANIFEST_FILE).is_file()
        # each node: both ranks' optimizer files, the small items (read by every rank) apart from the moments
        assert sorted(p.name for p in (cwd / node / "epoch_0_step_6" / "optim").glob("*.distcp")) == [
            "__0_0.distcp", "__0_1.distcp", "__1_0.distcp", "__1_1.distcp"]
    assert sorted(p.name for p in (cwd / "run" / "epoch_0_step_4" / "optim").glob("*.distcp")) == [
        "__0_0.distcp", "__1_0.distcp"]  # the durable tier's layout is unchanged
    assert sorted(p.name for p in (cwd / "run").glob("epoch_*")) == ["epoch_0_step_4"]
    kept = tmp_path_factory.mktemp("killed_kept")
    for name in ("run", "node0", "node1"):
        shutil.copytree(cwd / name, kept / name, symlinks=True)
    return cwd, kept


@pytest.fixture
def killed(killed_state):
    """The killed state, as it was left, in its own place."""
    cwd, kept = killed_state
    for name in ("run", "node0", "node1"):
        shutil.rmtree(cwd / name, ignore_errors=True)
        shutil.copytree(kept / name, cwd / name, symlinks=True)
    return cwd


def _same_losses(run_dir, straight, first_step, exact=True):
    got = _records(run_dir)
    assert sorted(got) == list(range(1, 9))
    for step in range(first_step, 9):
        assert got[step]["sample_ids"] == straight[step]["sample_ids"]
        if exact:
            assert got[step]["loss"] == straight[step]["loss"]
        else:
            assert got[step]["loss"] == pytest.approx(straight[step]["loss"], abs=1e-5)


def test_a_lost_node_resumes_from_the_newest_local_step_bitwise(killed, straight, assets):
    work = killed
    assert oct((work / "node0").stat().st_mode & 0o777) == "0o700"  # private to the user
    shutil.rmtree(work / "node1")  # that node is gone: its replacement starts with an empty folder
    out = _two_nodes(work, assets)
    start = _starts(work / "run")[-1]
    assert start["tier"] == "local" and start["resumed_from"] == "epoch_0_step_6" and start["step"] == 6
    assert "Resumed from the node-local tier: epoch_0_step_6 (newer than the durable tier's epoch_0_step_4)" in out
    _same_losses(work / "run", straight, 7)
    assert not (work / "node0").exists() and not (work / "node1").exists()  # a finished run removes them


def test_the_local_tier_reshards_onto_one_process(killed, straight, assets):
    work = killed
    out = ckpt_train(work, assets, *ARGS, "--checkpoint.checkpoint_dir", "run", "--checkpoint.local.dir",
                     str(work / "node1"), nproc=1).stdout
    assert "Resuming at world size 1 (checkpoint written by 2)" in out
    assert _starts(work / "run")[-1]["tier"] == "local"
    _same_losses(work / "run", straight, 7, exact=False)


def _damage(work, *nodes):
    for node in nodes:
        shard = max((work / node / "epoch_0_step_6" / "model").glob("*.safetensors"), key=lambda p: p.stat().st_size)
        data = bytearray(shard.read_bytes())
        data[-100] ^= 0xFF  # same size, another checksum
        shard.write_bytes(bytes(data))


def test_a_local_step_damaged_everywhere_is_never_loaded(killed, straight, assets):
    work = killed
    _damage(work, "node0", "node1")
    out = _two_nodes(work, assets)
    assert "the node-local step epoch_0_step_6 is damaged" in out  # found by the load, which hashes what it reads
    assert "local step epoch_0_step_6" in out and "not resuming from it" in out
    start = _starts(work / "run")[-1]
    assert start["tier"] == "durable" and start["resumed_from"] == "epoch_0_step_4"
    _same_losses(work / "run", straight, 5)


def test_a_copy_damaged_on_one_node_is_replaced_by_the_other_nodes(killed, straight, assets):
    """The load finds node 0's copy damaged; every file is then checked, and node 1 sends its good copy over it."""
    work = killed
    _damage(work, "node0")
    out = _two_nodes(work, assets)
    assert "the node-local step epoch_0_step_6 is damaged" in out and "checking every file" in out
    start = _starts(work / "run")[-1]
    assert start["tier"] == "local" and start["resumed_from"] == "epoch_0_step_6"
    _same_losses(work / "run", straight, 7)


def test_restarted_workers_recover_by_themselves(straight, tmp_path, assets):
    """Rank 1 dies in the middle of the local step 6 (never selected: the restart resumes from the durable step 4),
    then, once restarted, right after the local step 6 is committed (the next restart resumes from it). The run
    then finishes by itself."""
    (tmp_path / "markers").mkdir()
    env = {"DIE_DURING_LOCAL_STEP": "6", "DIE_AFTER_LOCAL_STEP": "6", "DIE_RANKS": "1",
           "DIE_MARKERS": str(tmp_path / "markers"), "PYTHONPATH": str(REPO)}
    result = ckpt_train(tmp_path, assets, *ARGS, "--recipe", f"{RECIPES}.DieDuringLocalStepRecipe",
                        "--checkpoint.checkpoint_dir", "run", "--checkpoint.local.dir", str(tmp_path / "local"),
                        nproc=2, launcher=("--max-restarts", "4"), env=env)
    starts = _starts(tmp_path / "run")
    assert [(s["tier"], s["resumed_from"]) for s in starts] == [
        (None, None), ("durable", "epoch_0_step_4"), ("local", "epoch_0_step_6")], \
        result.output[-3000:] + "\n".join(map(str, jsonl(tmp_path / "run" / layout.EVENTS_LOG)))
    _same_losses(tmp_path / "run", straight, 1)
