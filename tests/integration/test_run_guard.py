"""One run per checkpoint_dir, and workers that die with their launcher, on real 2-process jobs.

``first_run`` trains a 2-process job straight through, except that while it holds its checkpoint_dir it is paused
(SIGSTOP, so the test does not race its end) and the folder is claimed twice more: by a second ``ckpt-train`` run
and by two ranks started by plain ``torchrun`` (which has no launcher check: the ranks take the lock as a run's
checkpointer does, rank 0 for all). Both must be refused, naming the holder, and the first run must finish
untouched. Its losses then serve as the straight run the kill storm is compared with.

The storm SIGKILLs the launcher's process group only, as ``kill -9 -PGID``, a wrapper script or the OOM killer
would: torch's elastic agent starts the workers in sessions of their own, so the signal does not reach them. The
workers must be gone a few seconds later without having trained or published past the moment of the kill, the
killed run's lock must not block the next run, and the run that finishes must log the straight run's losses.

On 3-process jobs of a streamed corpus with 2 DataLoader workers per rank: a job killed the same way (its data
workers stopped first) is resumed by a rerun started at once, and a job with ``--max-restarts`` whose rank 0, then
a data worker, is killed is restarted twice and finishes; no data worker outlives its rank.
"""

from __future__ import annotations

import json
import os
import signal
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from automodel_ckpt.ondisk import catalog, layout
from automodel_ckpt.checkpoint.storage.runlock import RunLock
from tests.integration.harness import CKPT_TRAIN, QUIET, RECIPE, Result, _alive, ckpt_train, env_for, jsonl, losses, \
    process_tree, run_command, start_command

MAX_STEPS = 8
ARGS = ("--step_scheduler.max_steps", str(MAX_STEPS), "--step_scheduler.ckpt_every_steps", "2",
        "--data.val_size", "64", "--checkpoint.save_consolidated", "false")
TIMEOUT = 300  # generous: each wait below ends as soon as what it waits for happens
CLAIM = """
import sys
from automodel_ckpt.checkpoint.storage.runlock import hold
from automodel_ckpt.distributed.env import init_distributed
hold(sys.argv[1], init_distributed("gloo").rank)
"""


def start(cwd: Path, assets: Path, ckpt_dir: str, log: Path) -> subprocess.Popen:
    cmd = [CKPT_TRAIN, "--nproc-per-node", "2", str(RECIPE), *QUIET, *ARGS, "--checkpoint.checkpoint_dir", ckpt_dir]
    with open(log, "w") as out:
        return start_command(cmd, cwd=cwd, env=env_for(assets), stdout=out, stderr=subprocess.STDOUT,
                             start_new_session=True)


def wait_for(what: str, ready, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not ready():
        assert proc.poll() is None, f"the run ended ({proc.returncode}) before {what}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def recorded(root: Path) -> dict | None:
    """The lock file's holder record, or None (no file yet, or the lock taken and its record not yet written)."""
    try:
        info = json.loads((root / layout.RUN_LOCK).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def last_step(root: Path) -> int:
    try:
        return max((r["step"] for r in jsonl(root / layout.TRAINING_LOG)), default=0)
    except (FileNotFoundError, json.JSONDecodeError):  # not written yet, or a line being written
        return 0


@dataclass
class FirstRun:
    root: Path
    returncode: int
    log: str
    holder: dict
    launcher_pid: int
    via_launcher: Result
    via_torchrun: Result


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, assets) -> FirstRun:
    cwd = tmp_path_factory.mktemp("run_guard")
    root, log = cwd / "shared", cwd / "first.log"
    proc = start(cwd, assets, "shared", log)
    lock = RunLock(root)
    try:
        # the lock is taken, then its record written: wait for both
        wait_for("the run to take its checkpoint_dir and record itself",
                 lambda: lock.holder() is not None and recorded(root) is not None, proc, log)
        holder = recorded(root)
        job = process_tree(proc.pid)
        for pid in job:
            os.kill(pid, signal.SIGSTOP)
        try:
            second = ckpt_train(cwd, assets, *ARGS, "--checkpoint.checkpoint_dir", "shared", nproc=2, check=False,
                                timeout=TIMEOUT)
            (cwd / "claim.py").write_text(CLAIM)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   str(cwd / "claim.py"), "shared"]
            done = subprocess.run(cmd, cwd=cwd, env=env_for(assets), capture_output=True, text=True, timeout=TIMEOUT)
            third = Result(done.returncode, done.stdout, done.stderr)
        finally:
            for pid in job:
                os.kill(pid, signal.SIGCONT)
        proc.wait(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return FirstRun(root, proc.returncode, log.read_text(), holder, proc.pid, second, third)


def test_a_second_run_on_the_same_checkpoint_dir_is_refused_naming_the_holder(first_run, assets):
    holder = f"pid {first_run.holder['pid']} (launcher pid {first_run.launcher_pid})"
    refused = first_run.via_launcher
    assert refused.returncode != 0
    lines = [line for line in refused.output.splitlines() if line.strip()]
    assert len(lines) == 1, refused.output
    assert lines[0].startswith(f"error: checkpoint.checkpoint_dir 'shared' is in use by another run "
                               f"(host {first_run.holder['host']}, {holder}, since ")
    # ranks started by plain torchrun: every rank fails with the same line (rank 0's finding), none hangs
    ranks = [line for line in first_run.via_torchrun.output.splitlines() if "is in use by another run" in line]
    assert first_run.via_torchrun.returncode != 0
    assert len(ranks) == 2 and all(holder in line for line in ranks), first_run.via_torchrun.output[-3000:]
    # the first run finished as if alone
    assert first_run.returncode == 0, first_run.log[-3000:]
    assert len(losses(first_run.root)) == MAX_STEPS
    assert not (first_run.root / layout.RUN_LOCK).exists()
    out = run_command([CKPT_TRAIN, "verify", str(first_run.root)], env=env_for(assets), timeout=TIMEOUT)
    assert out.returncode == 0 and f"verify: OK ({MAX_STEPS // 2} checkpoint(s))" in out.stdout, out.stdout + out.stderr


def test_workers_die_with_their_launcher_and_a_kill_storm_then_a_rerun_gives_the_straight_losses(
        first_run, tmp_path, assets):
    root = tmp_path / "storm"
    for kill, ahead in enumerate((1, 2, 1)):
        log = tmp_path / f"kill_{kill}.log"
        before = last_step(root)  # the killed runs' lines past their last checkpoint are rewritten by the next
        proc = start(tmp_path, assets, "storm", log)
        wait_for(f"step {before + ahead}", lambda: last_step(root) >= before + ahead, proc, log)
        workers = [pid for pid in process_tree(proc.pid) if pid != proc.pid]
        at_kill = last_step(root)
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher's process group only
        proc.wait(timeout=TIMEOUT)
        assert len(workers) >= 2
        deadline = time.monotonic() + TIMEOUT
        while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        alive = [pid for pid in workers if _alive(pid)]
        for pid in alive:
            os.kill(pid, signal.SIGKILL)
        assert not alive, f"kill {kill}: workers {alive} outlived their launcher"
        # nothing trained or published after the kill (a step or save already under way may complete)
        assert last_step(root) <= at_kill + 1, f"kill {kill}: training went on from step {at_kill}"
        published = [r.step for r in catalog.scan_checkpoints(root)] if root.exists() else []
        assert max(published, default=0) <= at_kill + 1, f"kill {kill}: published {published} after step {at_kill}"
        assert "already exists" not in log.read_text()
    rerun = ckpt_train(tmp_path, assets, *ARGS, "--checkpoint.checkpoint_dir", "storm", nproc=2, timeout=TIMEOUT)
    assert "Loading checkpoint from" in rerun.output  # resumed, the killed runs' lock notwithstanding
    assert losses(root) == losses(first_run.root)
    assert [p.name for p in root.iterdir() if p.name.startswith(".")] == []


def test_a_rerun_of_a_finished_run_does_nothing_and_leaves_no_lock(first_run, tmp_path, assets):
    """A run whose checkpoint is already the last step ends at once, as a finished run ends: its lock removed (the
    workers' exit handlers are not the launcher's, so the recipe releases it, not an exit handler)."""
    shutil.copytree(first_run.root, tmp_path / "done")
    rerun = ckpt_train(tmp_path, assets, *ARGS, "--checkpoint.checkpoint_dir", "done", nproc=2, timeout=TIMEOUT)
    assert f"Training already complete at step {MAX_STEPS}" in rerun.output
    assert [p.name for p in (tmp_path / "done").iterdir() if p.name.startswith(".")] == []


# --- a killed run's data workers --------------------------------------------------------------------------------
# A rank's DataLoader workers are forked from it. They must die with it at once, and never hold the folder's lock:
# the run started right after a kill (by hand, or by the agent's restart) takes the folder. The data workers of a
# rank about to die are SIGSTOPped first, so that they cannot notice its death by themselves (torch's own check of
# their parent runs every 5 s): one that kept the lock, or outlived its rank, would do so for good.

STREAM_STEPS = 8
STREAM_ARGS = ("--step_scheduler.max_steps", str(STREAM_STEPS), "--step_scheduler.ckpt_every_steps", "2",
               "--step_scheduler.global_batch_size", "6", "--step_scheduler.local_batch_size", "2",
               "--data.seq_length", "32", "--data.shuffle_buffer", "20", "--data.num_workers", "2",
               "--checkpoint.save_consolidated", "false")


@pytest.fixture(scope="module")
def streamed(tmp_path_factory) -> Path:
    """The streamed pretraining recipe on a corpus of a few small json-lines files, without validation."""
    from omegaconf import OmegaConf

    from tests.integration.harness import REPO

    root = tmp_path_factory.mktemp("streamed_guard")
    (root / "corpus").mkdir()
    for f in range(4):
        rows = (json.dumps({"text": f"file {f} row {r}: {r * 7 % 90} plus {r % 13} is {r * 7 % 90 + r % 13}."})
                for r in range(30))
        (root / "corpus" / f"part-{f}.jsonl").write_text("\n".join(rows) + "\n")
    cfg = OmegaConf.load(REPO / "recipes" / "tiny_llama_pretrain.yaml")
    cfg.dataset = {"_target_": "automodel_ckpt.data.stream.corpus.streamed_corpus",
                   "path": str(root / "corpus" / "*.jsonl")}
    cfg.validation_dataset = None
    OmegaConf.save(cfg, root / "stream.yaml")
    return root / "stream.yaml"


def start_streamed(cwd: Path, assets: Path, recipe: Path, log: Path, *launcher: str) -> subprocess.Popen:
    cmd = [CKPT_TRAIN, "--nproc-per-node", "3", *launcher, str(recipe), *QUIET, *STREAM_ARGS,
           "--checkpoint.checkpoint_dir", "run"]
    with open(log, "w") as out:
        return start_command(cmd, cwd=cwd, env=env_for(assets), stdout=out, stderr=subprocess.STDOUT,
                             start_new_session=True)


def children(pid: int) -> list[int]:
    return [p for p in process_tree(pid) if p != pid and _parent(p) == pid]


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def _holder_pid(root: Path) -> int | None:
    return (recorded(root) or {}).get("pid")


def running_with_data_workers(proc: subprocess.Popen, root: Path, log: Path, *, past: int,
                              not_rank0: int | None = None) -> tuple[int, list[int]]:
    """Once the job has published checkpoint ``past`` (or a later one) and every rank runs its 2 data workers:
    rank 0's pid (the lock's holder, another than ``not_rank0``) and its data workers' pids."""
    def ready() -> bool:
        ranks, holder = children(proc.pid), _holder_pid(root)
        newest = max((r.step for r in catalog.scan_checkpoints(root)), default=0) if root.exists() else 0
        return (newest >= past and holder in ranks and holder != not_rank0 and len(ranks) == 3
                and all(len(children(r)) == 2 for r in ranks))

    wait_for(f"checkpoint {past} and every rank's data workers", ready, proc, log)
    rank0 = _holder_pid(root)
    return rank0, children(rank0)


def gone(pids: list[int]) -> list[int]:
    """The processes of ``pids`` still alive once the others have ended (bounded wait), SIGKILLed then."""
    deadline = time.monotonic() + 60
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = [pid for pid in pids if _alive(pid)]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    return alive


def test_a_run_killed_with_its_data_workers_running_is_resumed_by_a_rerun_started_at_once(
        streamed, tmp_path, assets):
    root, log = tmp_path / "run", tmp_path / "killed.log"
    proc = start_streamed(tmp_path, assets, streamed, log)
    try:
        rank0, _ = running_with_data_workers(proc, root, log, past=2)
        workers = [w for rank in children(proc.pid) for w in children(rank)]
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher's process group only, as `kill -9 -PGID` does
        proc.wait(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    rerun = ckpt_train(tmp_path, assets, *STREAM_ARGS, "--checkpoint.checkpoint_dir", "run", nproc=3,
                       recipe=streamed, check=False, timeout=TIMEOUT)
    left = gone(workers)
    assert rerun.returncode == 0, rerun.output[-3000:]
    assert "Loading checkpoint from run/epoch_0_step_" in rerun.output and "in use by" not in rerun.output
    assert sorted({r["step"] for r in jsonl(root / layout.TRAINING_LOG)}) == list(range(1, STREAM_STEPS + 1))
    assert not left, f"data workers {left} outlived their ranks (rank 0: {rank0})"
    assert not (root / layout.RUN_LOCK).exists()


def test_with_max_restarts_a_killed_rank_then_a_killed_data_worker_are_restarted_and_the_run_finishes(
        streamed, tmp_path, assets):
    """Rank 0 SIGKILLed (its data workers stopped), then, once the restarted job has saved again, a data worker of
    the new rank 0 SIGKILLed (its sibling stopped): each time the agent restarts the job, which resumes."""
    root, log = tmp_path / "run", tmp_path / "restarted.log"
    proc = start_streamed(tmp_path, assets, streamed, log, "--max-restarts", "2")
    stopped: list[int] = []
    try:
        first, workers = running_with_data_workers(proc, root, log, past=2)
        stopped += workers
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        os.kill(first, signal.SIGKILL)
        second, (killed, still) = running_with_data_workers(proc, root, log, past=4, not_rank0=first)
        stopped.append(still)
        os.kill(still, signal.SIGSTOP)
        os.kill(killed, signal.SIGKILL)
        proc.wait(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    output = log.read_text()
    left = gone(stopped)
    assert proc.returncode == 0, output[-3000:]
    resumed = [line.split()[-1] for line in output.splitlines() if "Loading checkpoint from" in line]
    assert len(resumed) == 2 and "in use by" not in output, output[-3000:]
    assert sorted({r["step"] for r in jsonl(root / layout.TRAINING_LOG)}) == list(range(1, STREAM_STEPS + 1))
    assert not left, f"data workers {left} outlived their rank ({first}, then {second})"
