"""Async checkpointing and preemption, end to end on 2 processes (docs/async.md).

* An async run writes the same checkpoint contents as a sync run at the same steps, in both model formats.
* SIGTERM mid-run (to the launcher only, to the workers only, or to every process of the job the way Slurm
  does) ends with a complete checkpoint, exit code 0 and the "Preempted by" message; rerunning the same command
  resumes exactly (bitwise-equal losses to an uninterrupted run).

Eight ``ckpt-train`` runs in all, each cached at module level and shared by the assertions that read it
(``RUN_SLOW=1`` adds a resume of every preempted run, not only the first). The unit tests in
tests/unit/checkpoint/save/test_async_checkpoint.py cover when LATEST moves (only once the background write is complete).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from functools import cache
from pathlib import Path

import pytest
import yaml

from automodel_ckpt.ondisk import catalog, layout, manifest
from automodel_ckpt.ondisk.durable import read_pointer
from automodel_ckpt.launch import worker_pids
from tests.integration.contents import comparable
from tests.integration.harness import CKPT_TRAIN, QUIET, RECIPE, REPO, ckpt_train, env_for, kill_job, losses, \
    start_command

pytestmark = pytest.mark.integration

FORMATS = ("safetensors", "torch_save")
MAX_STEPS = 8
COMMON = ("--step_scheduler.max_steps", str(MAX_STEPS), "--step_scheduler.ckpt_every_steps", "4",
          "--checkpoint.save_consolidated", "false", "--data.val_size", "64")
DELIVERIES = ("launcher", "workers", "job")
DEADLINE_S = 300


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("async")


@cache
def _run(work: Path, assets: Path, fmt: str, is_async: bool) -> Path:
    run_dir = f"{'async' if is_async else 'sync'}_{fmt}"
    ckpt_train(work, assets, *COMMON, "--checkpoint.model_save_format", fmt,
               "--checkpoint.is_async", str(is_async).lower(), "--checkpoint.checkpoint_dir", run_dir, nproc=2)
    return work / run_dir


def _reference(work: Path, assets: Path) -> list[float]:
    return losses(_run(work, assets, "safetensors", False))


# --- async == sync -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_async_run_writes_the_same_checkpoints_as_sync(work, assets, fmt):
    sync_dir, async_dir = _run(work, assets, fmt, False), _run(work, assets, fmt, True)
    for name in ("epoch_0_step_4", "epoch_0_step_8"):
        s, a = sync_dir / name, async_dir / name
        assert manifest.verify_manifest(a, checksums=True).ok
        assert sorted(manifest.read_manifest(s)["files"]) == sorted(manifest.read_manifest(a)["files"])  # same files...
        assert comparable(s) == comparable(a)  # ...same tensors, rank files, global state and DCP metadata
        s_cfg, a_cfg = (yaml.safe_load((d / layout.CONFIG_FILE).read_text()) for d in (s, a))
        assert (s_cfg["checkpoint"].pop("is_async"), a_cfg["checkpoint"].pop("is_async")) == (False, True)
        s_cfg["checkpoint"].pop("checkpoint_dir"), a_cfg["checkpoint"].pop("checkpoint_dir")
        assert s_cfg == a_cfg
        s_meta, a_meta = (json.loads((d / "metadata.json").read_text()) for d in (s, a))
        for meta in (s_meta, a_meta):
            meta.pop("saved_at"), meta.pop("training_seconds")
        assert s_meta == a_meta
    assert read_pointer(async_dir, layout.LATEST) == "epoch_0_step_8"  # the final save was published at exit
    assert not list(async_dir.glob(".staging-*"))
    assert losses(async_dir) == losses(sync_dir) == _reference(work, assets)


# --- preemption ----------------------------------------------------------------------------------------------


def _preempt_args(delivery: str) -> tuple[str, ...]:
    fmt = "torch_save" if delivery == "workers" else "safetensors"
    return (*COMMON, "--checkpoint.is_async", "true", "--checkpoint.model_save_format", fmt,
            "--checkpoint.checkpoint_dir", f"preempt_{delivery}")


def _wait_for(predicate, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"the job ended ({proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


@cache
def _preempted(work: Path, assets: Path, delivery: str) -> tuple[int, str, Path]:
    """Start the job in a session of its own, SIGTERM it once training has logged a step; (code, output, dir)."""
    run_dir = work / f"preempt_{delivery}"
    log = work / f"preempt_{delivery}.log"
    cmd = [CKPT_TRAIN, "--nproc-per-node", "2", str(RECIPE), *QUIET, *_preempt_args(delivery)]
    with open(log, "w") as out:
        proc = start_command(cmd, cwd=work, env=env_for(assets), stdout=out, stderr=subprocess.STDOUT,
                             start_new_session=True)
    try:
        journal = run_dir / layout.TRAINING_LOG
        _wait_for(lambda: journal.exists() and journal.read_text().count("\n") >= 1, proc, "the first step")
        workers = worker_pids(proc.pid)
        assert len(workers) == 2, workers
        if delivery == "launcher":  # e.g. `kill -TERM <ckpt-train pid>`; Kubernetes signals PID 1 only
            os.kill(proc.pid, signal.SIGTERM)
        elif delivery == "workers":
            for pid in workers:
                os.kill(pid, signal.SIGTERM)
        else:  # every process of the job at once, as Slurm does: the launcher's group, and the workers, which
            os.killpg(proc.pid, signal.SIGTERM)  # torch starts in sessions of their own (so they get it twice)
            for pid in workers:
                os.kill(pid, signal.SIGTERM)
        code = proc.wait(timeout=DEADLINE_S)
    except BaseException:
        kill_job(proc)
        raise
    return code, log.read_text(errors="replace"), run_dir


@cache
def _rerun(work: Path, assets: Path, delivery: str) -> str:
    return ckpt_train(work, assets, *_preempt_args(delivery), nproc=2).output


def _resumes_exactly(delivery: str) -> bool:
    return delivery == "launcher" or os.environ.get("RUN_SLOW") == "1"


@pytest.mark.parametrize("delivery", DELIVERIES)
def test_sigterm_saves_a_resumable_checkpoint_and_exits_0(work, assets, delivery):
    code, output, run_dir = _preempted(work, assets, delivery)
    assert code == 0, output[-3000:]
    assert "Traceback" not in output
    found = [line for line in output.splitlines() if line.startswith("Preempted by SIGTERM at step ")]
    assert len(found) == 1, output[-3000:]
    step = int(found[0].split("at step ")[1].split(":")[0])
    assert 1 <= step < MAX_STEPS
    name = f"epoch_0_step_{step}"
    assert found[0] == (f"Preempted by SIGTERM at step {step}: saved preempt_{delivery}/{name}; "
                        "rerun the same command to resume")
    assert read_pointer(run_dir, layout.LATEST) == name  # complete and published before the job exited
    assert manifest.verify_manifest(run_dir / name, checksums=True).ok
    assert not list(run_dir.glob(".staging-*"))
    assert [c.step for c in catalog.scan_checkpoints(run_dir)][-1] == step
    reference = _reference(work, assets)
    assert losses(run_dir) == reference[:step]  # the steps it trained are the uninterrupted run's
    if _resumes_exactly(delivery):
        rerun = _rerun(work, assets, delivery)
        assert f"Loading checkpoint from preempt_{delivery}/{name}" in rerun
        assert losses(run_dir) == reference  # bitwise-equal to the uninterrupted run
        assert read_pointer(run_dir, layout.LATEST) == f"epoch_0_step_{MAX_STEPS}"


# --- a kill during an overlapped snapshot --------------------------------------------------------------------


def test_kill_during_an_overlapped_snapshot_publishes_nothing_and_resumes_from_the_previous(work, assets):
    """The copy of step 4's state is held in the background while step 5 trains up to its optimizer step (the
    fence); SIGKILL then. Step 4 is never published; the rerun resumes from step 2 and trains exactly."""
    run_dir, markers, log = work / "held", work / "held_markers", work / "held.log"
    markers.mkdir()
    args = (*COMMON, "--step_scheduler.ckpt_every_steps", "2", "--checkpoint.is_async", "true",
            "--checkpoint.checkpoint_dir", run_dir.name)
    cmd = [CKPT_TRAIN, "--nproc-per-node", "2", str(RECIPE), *QUIET, *args,
           "--recipe", "tests.integration.recipes_for_tests.HoldSnapshotRecipe"]
    with open(log, "w") as out:
        proc = start_command(cmd, cwd=work, env=env_for(assets, {"HOLD_AT_STEP": "4", "HOLD_MARKERS": str(markers),
                                                   "PYTHONPATH": str(REPO)}),
                             stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_for(lambda: all((markers / f"{m}{r}").exists() for m in ("capture", "fence") for r in (0, 1)), proc,
                  "the held snapshot and the next step's fence")
    finally:
        kill_job(proc)
    assert losses(run_dir) == _reference(work, assets)[:4]  # step 5 never finished: it waited at the fence
    assert [c.name for c in catalog.scan_checkpoints(run_dir)] == ["epoch_0_step_2"]
    assert read_pointer(run_dir, layout.LATEST) == "epoch_0_step_2"
    assert not (run_dir / "epoch_0_step_4").exists()
    assert not (run_dir / layout.staging_name("epoch_0_step_4")).exists()  # reserved only after the copy
    rerun = ckpt_train(work, assets, *args, nproc=2).output
    assert f"Loading checkpoint from {run_dir.name}/epoch_0_step_2" in rerun
    assert losses(run_dir) == _reference(work, assets)
    assert read_pointer(run_dir, layout.LATEST) == f"epoch_0_step_{MAX_STEPS}"
    assert not list(run_dir.glob(".staging-*"))
