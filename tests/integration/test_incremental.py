"""``checkpoint.incremental`` end to end: the tiny VLM (recipes/tiny_vlm_sft.yaml, its vision tower frozen) on 2 processes.

Short runs, shared by the tests: 6 steps straight, a checkpoint at every step and only the last one kept; a run
stopped and SIGKILLed while a save has linked its frozen shards but not yet published; its rerun to step 4 on 2
processes, its rank 0 SIGKILLed in the middle of its first prune and the job restarted by the agent
(``--max-restarts``); and that run continued to step 6 on 1 process. Then 5 steps on S3 (SeaweedFS) in two runs.
A synced DPO reference shared between the checkpoints of one sync: tests/integration/test_dpo.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from functools import cache
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from automodel_ckpt.ondisk import catalog, layout, manifest
from automodel_ckpt.ondisk.incremental import stored_once
from tests.integration import step_faults
from tests.integration.harness import (
    CKPT_TRAIN, QUIET, REPO, ckpt_train, env_for, jsonl, kill_job, losses, run_command, start_command, stop_job,
)

VLM_RECIPE = REPO / "recipes" / "tiny_vlm_sft.yaml"
ARGS = ("--dataset.num_samples", "160", "--data.val_size", "16", "--step_scheduler.val_every_steps", "null",
        "--step_scheduler.global_batch_size", "8", "--step_scheduler.local_batch_size", "4",
        "--step_scheduler.ckpt_every_steps", "1", "--checkpoint.incremental", "true",
        "--checkpoint.max_recent_checkpoints", "1", "--checkpoint.save_consolidated", "false")  # fmt: skip
_PARAMS = re.compile(r"Parameters: \S+ \(([\d,]+)\) trainable / \S+ \(([\d,]+)\) frozen")
STOP_IN_PRUNE = "tests.integration.prune_faults.StopInPruneVLMRecipe"  # rank 0 stops itself in its first prune


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("incremental")


@cache
def _straight(work: Path, assets: Path) -> tuple[Path, str]:
    result = ckpt_train(work, assets, *ARGS, "--checkpoint.checkpoint_dir", "straight", "--step_scheduler.max_steps",
                        "6", nproc=2, recipe=VLM_RECIPE)
    return work / "straight", result.output


def _linked_in_staging(run: Path) -> bool:
    """A save in progress has hard-linked a frozen shard from the previous checkpoint."""
    for staging in run.glob(f"{layout.STAGING_PREFIX}*"):
        for shard in (staging / layout.MODEL_DIR).glob("*.safetensors"):
            try:
                if shard.stat().st_nlink > 1:
                    return True
            except OSError:
                continue
    return False


@cache
def _killed(work: Path, assets: Path) -> Path:
    """A run stopped (SIGSTOP) as soon as a save has linked its frozen shards, then SIGKILLed."""
    run = work / "killed"
    cmd = [CKPT_TRAIN, "--nproc-per-node", "2", str(VLM_RECIPE), *QUIET, *ARGS, "--checkpoint.checkpoint_dir", "killed",
           "--step_scheduler.max_steps", "6"]
    with open(work / "killed.log", "w") as out:
        proc = start_command(cmd, cwd=work, env=env_for(assets), stdout=out, stderr=subprocess.STDOUT,
                             start_new_session=True)
    try:
        while proc.poll() is None and not _linked_in_staging(run):
            time.sleep(0.002)  # polling for the moment, not waiting for time: the job is stopped the moment it shows
        if proc.poll() is None:
            stop_job(proc)
    finally:
        kill_job(proc)
    assert proc.returncode != 0, (work / "killed.log").read_text()[-3000:]  # killed mid-run, not finished
    return run


@cache
def _rerun_killed_in_a_prune(work: Path, assets: Path) -> tuple[str, list[str]]:
    """The killed run rerun to step 4 with ``--max-restarts 1``: rank 0 stops itself in the middle of its first prune
    (``prune_faults``: the pruned checkpoint renamed ``.deleting-*``, part of its files removed), is SIGKILLed
    there, and the agent restarts the job, which resumes from the newest published checkpoint and finishes. Returns
    the output and, as the disk was at the kill, the published checkpoints and the hidden folders left with files."""
    run, pid_file, log = work / "killed", work / "prune.pid", work / "rerun.log"
    cmd = [CKPT_TRAIN, "--nproc-per-node", "2", "--max-restarts", "1", str(VLM_RECIPE), *QUIET, *ARGS,
           "--checkpoint.checkpoint_dir", "killed", "--step_scheduler.max_steps", "4", "--recipe", STOP_IN_PRUNE]
    env = env_for(assets, {"STOP_IN_PRUNE": str(pid_file), "PYTHONPATH": str(REPO)})
    with open(log, "w") as out:
        proc = start_command(cmd, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        pid = step_faults.stopped(pid_file, proc)  # the pid prune_faults wrote, once stopped
        assert pid is not None, log.read_text()[-3000:]
        published = catalog.scan_checkpoints(run)
        assert published and all(manifest.verify_manifest(c.path).ok for c in published)  # while the prune is cut short
        hidden = [p.name for p in run.glob(f"{layout.DELETING_PREFIX}*") if any(f.is_file() for f in p.rglob("*"))]
        os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            kill_job(proc)
    output = log.read_text()
    assert proc.returncode == 0, output[-3000:]
    return output, [c.name for c in published] + hidden


def test_saves_after_the_first_write_no_frozen_byte_and_keep_last_one_keeps_only_the_last(work, assets, vlm_base):
    run, output = _straight(work, assets)
    trainable, frozen = (int(n.replace(",", "")) for n in _PARAMS.search(output).groups())
    trainable_state = trainable * 4 * 3  # float32 weights and AdamW's two moments
    saves = [r for r in jsonl(run / layout.EVENTS_LOG) if r["event"] == "checkpoint"]
    assert len(saves) == 6 and saves[0]["written_bytes"] == saves[0]["bytes"]
    for save in saves[1:]:
        # the frozen tower (and the buffers) are linked, not written: what is written is the trained state, with
        # its files' framing (a compact torch.save record per optimizer tensor, the optimizer's .metadata) and the
        # small per-rank files
        assert save["written_bytes"] <= save["bytes"] - frozen * 4, save
        assert save["written_bytes"] <= 1.05 * trainable_state, (save["written_bytes"] / trainable_state, save)
    assert "% of a full save" in output  # the end-of-run cost line
    left = [c.name for c in catalog.scan_checkpoints(run)]
    assert left == ["epoch_0_step_6"]
    last = run / "epoch_0_step_6"
    assert manifest.verify_manifest(last).ok and manifest.read_manifest(last)["linked_bytes"] > frozen * 4
    on_disk = [p for p in run.rglob("*") if p.is_file() and not p.is_symlink() and p.parent != run]
    assert stored_once([last]) == sum(p.stat().st_size for p in on_disk)  # nothing else stored in the run folder
    assert all(p.stat().st_nlink == 1 for p in on_disk)  # the older checkpoints' links are gone with them


def test_a_kill_during_a_save_or_a_prune_leaves_every_published_checkpoint_verifying_and_the_rerun_bitwise(
        work, assets, vlm_base):
    straight, _ = _straight(work, assets)
    run = _killed(work, assets)
    published = catalog.scan_checkpoints(run)
    assert published and all(manifest.verify_manifest(c.path).ok for c in published)
    assert list(run.glob(f"{layout.STAGING_PREFIX}*"))  # the kill landed inside a save
    output, at_prune_kill = _rerun_killed_in_a_prune(work, assets)
    assert f"Loading checkpoint from killed/{published[-1].name}" in output
    # SIGKILLed in its first prune: the checkpoint it had just published (verified there), and the one it was
    # removing, hidden, some of its files still there (which the published one may link); the restart resumes from
    # the published one and its next save's prune removes what is left of the other
    assert len(at_prune_kill) == 2, at_prune_kill
    kept, removing = at_prune_kill
    assert removing == f"{layout.DELETING_PREFIX}{published[-1].name}", at_prune_kill
    assert output.count(f"Loading checkpoint from killed/{kept}") == 1, output[-3000:]
    got = {r["step"]: r["loss"] for r in jsonl(run / "training.jsonl")}
    want = {r["step"]: r["loss"] for r in jsonl(straight / "training.jsonl")}
    assert sorted(got) == [1, 2, 3, 4] and all(got[s] == want[s] for s in got)  # bit for bit
    assert manifest.verify_manifest(run / "epoch_0_step_4").ok
    assert [c.name for c in catalog.scan_checkpoints(run)] == ["epoch_0_step_4"]
    assert not list(run.glob(f"{layout.DELETING_PREFIX}*"))
    events = jsonl(run / layout.EVENTS_LOG)
    starts = [i for i, r in enumerate(events) if r["event"] == "start"]
    first = next(r for r in events[starts[-1]:] if r["event"] == "checkpoint")
    assert first["written_bytes"] < first["bytes"]  # the rerun's first save linked the resumed checkpoint's shards


def test_resume_on_one_process_from_two(work, assets, vlm_base):
    straight, _ = _straight(work, assets)
    run = _killed(work, assets)
    if not (run / "epoch_0_step_4").is_dir():
        test_a_kill_during_a_save_or_a_prune_leaves_every_published_checkpoint_verifying_and_the_rerun_bitwise(
            work, assets, vlm_base)
    result = ckpt_train(work, assets, *ARGS, "--checkpoint.checkpoint_dir", "killed", "--step_scheduler.max_steps",
                        "6", nproc=1, recipe=VLM_RECIPE)
    assert "Resuming at world size 1 (checkpoint written by 2)" in result.output
    got = {r["step"]: r["loss"] for r in jsonl(run / "training.jsonl")}
    want = {r["step"]: r["loss"] for r in jsonl(straight / "training.jsonl")}
    assert sorted(got) == list(range(1, 7))
    for step in (5, 6):  # another world size sums the batch in another order: equal to rounding
        assert got[step] == pytest.approx(want[step], abs=1e-5)
    last = run / "epoch_0_step_6"
    # step 6 linked step 5's shard
    assert manifest.verify_manifest(last).ok and manifest.read_manifest(last).get("linked_bytes")
    # incremental storage loses nothing: the same run saved whole (2 processes to step 4, one full save) and resumed
    # on 1 process computes the same losses bit for bit
    whole = (*ARGS, "--checkpoint.incremental", "false", "--step_scheduler.ckpt_every_steps", "4",
             "--checkpoint.checkpoint_dir", "whole")
    ckpt_train(work, assets, *whole, "--step_scheduler.max_steps", "4", nproc=2, recipe=VLM_RECIPE)
    ckpt_train(work, assets, *whole, "--step_scheduler.max_steps", "6", nproc=1, recipe=VLM_RECIPE)
    assert {r["step"]: r["loss"] for r in jsonl(work / "whole" / "training.jsonl")} == got


def test_on_an_object_store_frozen_shards_are_pieces_uploaded_once_and_keep_last_one_keeps_the_last_ones(
        work, assets, vlm_base, seaweed, tmp_path):
    """On S3 (SeaweedFS), keep-last 1 across 5 saves in two launches (3 steps, then 5 from an empty staging folder):
    each rank's frozen shard is uploaded once, as a piece of the run folder, and every later save references it
    instead of uploading it; the bucket keeps only the pieces the kept checkpoints reference; the resume is bitwise;
    ``inspect`` shows the pieces as shared; ``verify`` passes, and names a deleted piece in one line; ``gc`` deletes
    an orphaned piece and keeps the referenced ones."""
    straight, output = _straight(work, assets)
    frozen = int(_PARAMS.search(output).group(2).replace(",", ""))
    bucket = seaweed.new_bucket()
    url, root, fs = f"s3://{bucket}/run", f"{bucket}/run", seaweed.filesystem()
    env = seaweed.env(XDG_CACHE_HOME=str(tmp_path / "cache"))
    for steps, stage in (("3", "stage1"), ("5", "stage2")):
        ckpt_train(tmp_path, assets, *ARGS, "--checkpoint.checkpoint_dir", url, "--checkpoint.staging_dir",
                   str(tmp_path / stage), "--step_scheduler.max_steps", steps, nproc=2, recipe=VLM_RECIPE, env=env)
    names = {p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False) if fs.exists(f"{p}/{layout.MANIFEST_FILE}")}
    assert names == {"epoch_0_step_3", "epoch_0_step_5"}  # keep-last 1, and the checkpoint resumed from

    def refs(name: str) -> dict[str, str]:
        return json.loads(fs.cat(f"{root}/{name}/{layout.PIECE_REFS}"))["files"]

    def stored() -> set[str]:
        return {p.rsplit("/", 1)[-1] for p in fs.find(f"{root}/{layout.PIECES_DIR}")}

    last = refs("epoch_0_step_5")
    assert len(last) == 2 and refs("epoch_0_step_3") == last  # each rank's frozen shard, the same bytes throughout
    assert stored() == set(last.values())  # the pieces of the 3 checkpoints pruned were the same ones: none left over
    for name in names:
        table = json.loads(fs.cat(f"{root}/{name}/{layout.MANIFEST_FILE}"))
        for rel, entry in table["files"].items():  # every other file whole under the prefix; no copy of a piece
            assert fs.exists(f"{root}/{name}/{rel}") == (rel not in last), rel
    events = [json.loads(line) for line in fs.cat(f"{root}/{layout.EVENTS_LOG}").decode().splitlines() if line]
    saves = {r["step"]: r for r in events if r["event"] == "checkpoint"}  # the store's log: each launch's last too
    assert sorted(saves) == [1, 2, 3, 4, 5] and saves[1]["written_bytes"] == saves[1]["bytes"]
    for step in (2, 3, 4, 5):  # the first save after the resume too: the pieces were found in the bucket
        assert saves[step]["written_bytes"] <= saves[step]["bytes"] - frozen * 4, saves[step]
    got = [json.loads(line)["loss"] for line in fs.cat(f"{root}/training.jsonl").decode().splitlines() if line]
    assert got == losses(straight)[:5]  # bit for bit

    def verb(*args: str) -> subprocess.CompletedProcess:
        return run_command([CKPT_TRAIN, *args], env=env_for(assets, env), timeout=600)

    listing = json.loads(verb("inspect", url, "--json").stdout)
    assert all(r["shared_bytes"] >= frozen * 4 for r in listing["checkpoints"]), listing["checkpoints"]
    totals = listing["totals"]  # each piece stored once
    assert totals["stored_bytes"] == totals["size_bytes"] - listing["checkpoints"][0]["shared_bytes"]
    done = verb("verify", f"{url}/epoch_0_step_5")
    assert done.returncode == 0, done.stdout + done.stderr
    # consolidate reads the pieces back: the frozen tower it exports is the straight run's, bit for bit
    for src, out in ((f"{url}/epoch_0_step_5", tmp_path / "hf_s3"), (str(straight / "epoch_0_step_6"), tmp_path / "hf")):
        done = verb("consolidate", src, "--out", str(out), "--no-progress")
        assert done.returncode == 0, done.stdout + done.stderr
    exported, reference = _tensors(tmp_path / "hf_s3"), _tensors(tmp_path / "hf")
    tower = [k for k in reference if "vision" in k]
    assert tower and all(torch.equal(exported[k], reference[k]) for k in tower)

    orphan = f"{root}/{layout.PIECES_DIR}/{'0' * 32}"  # a piece no checkpoint references
    fs.pipe(orphan, b"left by a save that never committed")
    done = verb("gc", url, "--min-age-minutes", "0")
    assert "gc: 1 unreferenced piece(s) deleted" in done.stdout, done.stdout + done.stderr
    assert stored() == set(last.values())

    key = sorted(last.values())[0]
    fs.rm(f"{root}/{layout.PIECES_DIR}/{key}")
    done = verb("verify", f"{url}/epoch_0_step_5")
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert done.returncode != 0 and len(lines) == 1, lines
    assert f"{url}/{layout.PIECES_DIR}/{key}" in lines[0] and "missing" in lines[0], lines
