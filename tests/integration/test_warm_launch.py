"""The test harness's warm launches (``warm_launch``) behave as new ``ckpt-train`` processes do."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.integration.harness import CKPT_TRAIN, RECIPE, env_for, jsonl, kill_job, process_tree
from tests.integration.warm_launch import WarmLauncher


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    launcher = WarmLauncher(env_for(tmp_path_factory.mktemp("no_assets")))
    yield launcher
    launcher.close()


def test_a_warm_launch_prints_exits_and_sees_its_folder_and_environment_as_a_new_process(tmp_path, warm, assets):
    (tmp_path / "bad.yaml").write_text(RECIPE.read_text().replace("max_steps:", "max_stepz:"))
    env = env_for(assets, {"AUTOMODEL_CKPT_EXAMPLE": "1", "XDG_CACHE_HOME": str(tmp_path / "cache")})
    for args in (["--version"], ["bad.yaml"], ["bad.yaml", "--dry-run"], [str(RECIPE), "--dry-run", "--nope", "1"],
                 ["inspect", "no_such_folder"], []):
        cmd = [CKPT_TRAIN, *args]
        assert warm.accepts(cmd, env)
        fresh = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        forked = warm.run(cmd, tmp_path, env, timeout=300)
        assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert fresh.returncode == 2 and "usage: ckpt-train" in fresh.stdout  # the last one: no arguments


def test_a_warm_launch_trains_in_its_own_folder(tmp_path, warm, assets):
    cmd = [CKPT_TRAIN, "--nproc-per-node", "2", str(RECIPE), "--training.progress_bar", "false",
           "--step_scheduler.max_steps", "2", "--checkpoint.checkpoint_dir", "run", "--data.val_size", "64"]
    done = warm.run(cmd, tmp_path, env_for(assets), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["step"] for r in jsonl(tmp_path / "run" / "training.jsonl")] == [1, 2]  # the folder is the command's
    assert "Saving checkpoint to" in done.stdout


def test_a_warm_launch_past_its_timeout_is_killed_with_its_workers(tmp_path, warm, assets):
    cmd = [CKPT_TRAIN, "--nproc-per-node", "2", str(RECIPE), "--training.progress_bar", "false",
           "--step_scheduler.max_steps", "100000", "--checkpoint.enabled", "false"]
    before = set(process_tree(os.getpid()))
    with pytest.raises(subprocess.TimeoutExpired) as timed_out:
        warm.run(cmd, tmp_path, env_for(assets), timeout=5)
    # before the kill each of its processes printed where it stood, and the failure shows it
    assert "Fatal Python error: Aborted" in str(timed_out.value)
    assert "(most recent call first)" in str(timed_out.value)
    assert set(process_tree(os.getpid())) - before <= {warm._proc.pid}  # the server only: no launcher, no worker
    assert warm.run([CKPT_TRAIN, "--version"], tmp_path, env_for(assets), timeout=60).returncode == 0


def test_variables_read_at_import_time_start_a_new_interpreter(monkeypatch):
    warm = WarmLauncher(env_for(Path("/nonexistent")))
    base = env_for(Path("/elsewhere"))
    assert warm.accepts([CKPT_TRAIN, "x.yaml"], base)
    assert warm.accepts([CKPT_TRAIN, "x.yaml"], base | {"PYTHONPATH": "/somewhere", "CKPT_TEST_S3_SECRET": "s"})
    for name, value in (("PYTHONWARNINGS", "ignore"), ("HF_HOME", "/h"), ("OMP_NUM_THREADS", "2"),
                        ("AUTOMODEL_CKPT_MALLOC", "default"), ("LD_PRELOAD", "libjemalloc.so")):
        assert not warm.accepts([CKPT_TRAIN, "x.yaml"], base | {name: value}), name
    assert not warm.accepts(["python", "x.py"], base)
    # a cache folder of its own: Hugging Face's libraries read it at import only where HF_HOME is not set
    assert warm.accepts([CKPT_TRAIN, "x.yaml"], base | {"XDG_CACHE_HOME": "/c"})
    # applied again in the forked child (torch._inductor's compile_threads)
    assert warm.accepts([CKPT_TRAIN, "x.yaml"], base | {"TORCHINDUCTOR_COMPILE_THREADS": "1"})
    unset = {k: v for k, v in base.items() if k != "HF_HOME"}
    assert not WarmLauncher(unset).accepts([CKPT_TRAIN, "x.yaml"], unset | {"XDG_CACHE_HOME": "/c"})
    monkeypatch.setenv("CKPT_TEST_FRESH_PROCESSES", "1")
    assert not warm.accepts([CKPT_TRAIN, "x.yaml"], base)


def test_a_warm_job_streams_its_output_and_is_killed_as_a_started_one(tmp_path, warm, assets):
    """As ``subprocess.Popen``: its output read line by line from a pipe, a session of its own, SIGKILL to its
    process group and its workers ends it, ``wait`` and ``poll`` give the signal as a negative status."""
    cmd = [CKPT_TRAIN, "--nproc-per-node", "2", str(RECIPE), "--training.progress_bar", "false",
           "--step_scheduler.max_steps", "100000", "--step_scheduler.ckpt_every_steps", "2", "--data.val_size", "64",
           "--checkpoint.checkpoint_dir", "run"]
    proc = warm.popen(cmd, tmp_path, env_for(assets), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                      start_new_session=True)
    assert os.getsid(proc.pid) == proc.pid and proc.poll() is None
    for line in proc.stdout:
        if "Saving checkpoint to" in line:
            break
    assert "Saving checkpoint to" in line and "epoch_0_step_2" in line, line
    assert len(process_tree(proc.pid)) >= 3  # the launcher and its two workers
    assert kill_job(proc) >= 3
    assert proc.wait(timeout=60) == -signal.SIGKILL == proc.poll()
    assert proc.communicate(timeout=60)[1] is None
    done = warm.popen([CKPT_TRAIN, "nope.yaml"], tmp_path, env_for(assets), stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE, text=True)
    out, err = done.communicate(timeout=120)
    assert (done.returncode, out) == (2, "") and err.startswith("error: ") and "nope.yaml" in err


def test_a_server_that_dies_reports_its_commands_killed_and_the_next_command_starts_another(tmp_path, warm, assets):
    cmd = [CKPT_TRAIN, "--nproc-per-node", "1", str(RECIPE), "--training.progress_bar", "false",
           "--step_scheduler.max_steps", "100000", "--checkpoint.enabled", "false", "--data.val_size", "64"]
    proc = warm.popen(cmd, tmp_path, env_for(assets), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                      start_new_session=True)
    server = warm._proc
    server.kill()
    server.wait(timeout=60)
    assert proc.wait(timeout=60) == -signal.SIGKILL  # never waits for a status that cannot come
    for pid in process_tree(proc.pid):  # the orphaned job itself
        os.kill(pid, signal.SIGKILL)
    done = warm.run([CKPT_TRAIN, "--version"], tmp_path, env_for(assets), timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("ckpt-train ") and warm._proc is not server
