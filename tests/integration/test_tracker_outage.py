"""A real MLflow server killed mid-run: training never waits for it past the bound (one warning when it falls
behind), the run ends 0 with every checkpoint and the losses of a run without tracking, saying what was not
delivered; with the server back, a resume fills MLflow in: one run, every step once."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from automodel_ckpt.ondisk import layout
from automodel_ckpt.tracking.tracker import FLUSH_TIMEOUT_S
from tests.integration.harness import (CKPT_TRAIN, QUIET, RECIPE, ckpt_train, env_for, jsonl, kill_job, losses,
                                       run_command, start_command)
from tests.integration.mlflow_server import MISSING, MlflowServer, server_executable

pytest.importorskip("mlflow")

STEPS, MORE_STEPS, KILL_AT_STEP = 40, 46, 8
ARGS = ("--step_scheduler.ckpt_every_steps", "10", "--step_scheduler.val_every_steps", "10",
        "--step_scheduler.global_batch_size", "16", "--step_scheduler.local_batch_size", "8", "--data.val_size", "32",
        "--checkpoint.save_consolidated", "false", "--checkpoint.checkpoint_dir", "run")
SAVED = [f"epoch_0_step_{s}" for s in range(10, STEPS + 1, 10)]
CLOSE_S = "0.5"  # the outage run's end waits this long for the dead server (logging.close_timeout_s; 10 s by default)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    executable = server_executable()
    if executable is None:
        pytest.skip(MISSING)
    srv = MlflowServer(executable, tmp_path_factory.mktemp("mlflow-server"))
    srv.start()
    yield srv
    srv.stop()


def _tracked(uri: str) -> tuple[str, ...]:
    return ("--logging.mlflow.tracking_uri", uri, "--logging.mlflow.experiment", "outage")


@pytest.fixture(scope="module")
def outage(tmp_path_factory: pytest.TempPathFactory, assets: Path, server: MlflowServer) -> dict:
    """The run without tracking and, side by side with it, the same run whose server is killed at step
    KILL_AT_STEP (the plain run trains while the other waits for the dead server)."""
    plain = tmp_path_factory.mktemp("untracked")
    work = tmp_path_factory.mktemp("outage")
    base = [CKPT_TRAIN, "--nproc-per-node", "2", str(RECIPE), *QUIET, "--step_scheduler.max_steps", str(STEPS), *ARGS]
    cmd = [*base, *_tracked(server.uri), "--logging.close_timeout_s", CLOSE_S]
    t0 = time.monotonic()
    with open(plain / "plain.log", "w") as out:
        untracked = start_command(base, cwd=plain, env=env_for(assets), stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    with open(work / "outage.log", "w") as out:
        proc = start_command(cmd, cwd=work, env=env_for(assets), stdout=out, stderr=subprocess.STDOUT,
                             start_new_session=True)
    steps = work / "run" / layout.TRAINING_LOG
    deadline = time.monotonic() + 600
    try:
        while proc.poll() is None and time.monotonic() < deadline and server.proc is not None:
            if steps.exists() and max([r["step"] for r in jsonl(steps)] or [0]) >= KILL_AT_STEP:
                server.kill()  # mid-run: the tracker's next call finds nobody
            time.sleep(0.01)
        for job in (proc, untracked):
            try:
                job.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                kill_job(job)
    finally:
        for job in (proc, untracked):
            if job.poll() is None:
                kill_job(job)
    outage_s = time.monotonic() - t0
    assert untracked.returncode == 0, (plain / "plain.log").read_text()[-3000:]
    print(f"\nwall time, 2 processes, {STEPS} steps, beside the run without tracking: MLflow server killed at "
          f"step {KILL_AT_STEP}: {outage_s:.1f} s (bounds: {FLUSH_TIMEOUT_S:.0f} s at a checkpoint, "
          f"{CLOSE_S} s without progress at the end)")
    return {"plain": plain / "run", "run": work / "run", "rc": proc.returncode,
            "output": (work / "outage.log").read_text()}


def test_a_killed_server_ends_the_run_normally_with_every_checkpoint_and_the_same_losses(outage):
    run, output = outage["run"], outage["output"]
    assert outage["rc"] == 0, output[-3000:]
    assert losses(run) == losses(outage["plain"])
    for name in SAVED:
        assert (run / name / layout.MANIFEST_FILE).is_file(), name  # sealed and committed
    assert "not delivered (logging.mlflow " in output  # the end says what MLflow lacks


def test_training_waited_for_the_tracker_once_and_within_the_bound(outage, assets):
    events = jsonl(outage["run"] / layout.EVENTS_LOG)
    behind = [e for e in events if e["event"] == "tracking_behind"]
    assert len(behind) == 1 and behind[0]["backend"] == "mlflow"  # fell behind once, never waited for again
    assert behind[0].get("failed") or behind[0]["waited_s"] == FLUSH_TIMEOUT_S
    assert not [e for e in events if e["event"] == "tracking_caught_up"]  # the server never came back
    output = outage["output"]
    assert output.count("logging.mlflow is behind") + output.count("logging.mlflow failed") == 1
    assert "experiment tracking is 60 s behind" not in output
    shown = run_command([CKPT_TRAIN, "inspect", str(outage["run"]), "--cost", "--json"], env=env_for(assets), timeout=300)
    assert shown.returncode == 0, shown.stderr[-2000:]
    end = next(e for e in reversed(events) if e["event"] == "end")
    behind_s = end["time"] - behind[0]["time"]
    assert behind_s > 0 and json.loads(shown.stdout)["tracking_behind_s"] >= round(behind_s, 3) - 0.001  # to the end
    assert "; tracking behind " in output  # the end-of-run line


def test_with_the_server_back_a_resume_fills_mlflow_in_each_step_once(outage, server, assets):
    from mlflow.tracking import MlflowClient

    from automodel_ckpt.tracking.mlflow_backend import last_per_step

    server.start()  # the same store: the tracked run is still there
    work = outage["run"].parent
    # a restarted server may answer slowly on a loaded machine: the end waits while the replay makes progress (and up
    # to 60 s for any one call), so the run ends once MLflow has every step, however long the replay takes
    resumed = ckpt_train(work, assets, "--step_scheduler.max_steps", str(MORE_STEPS), *ARGS, *_tracked(server.uri),
                         "--logging.close_timeout_s", "60", nproc=2)
    assert "not delivered" not in resumed.output, resumed.output[-3000:]  # the replay caught up by the end
    client = MlflowClient(tracking_uri=server.uri)
    runs = client.search_runs([client.get_experiment_by_name("outage").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    history = client.get_metric_history(runs[0].info.run_id, "train/loss")
    expected = [(r["step"], r["loss"]) for r in jsonl(outage["run"] / layout.TRAINING_LOG)]
    assert [s for s, _ in expected] == list(range(1, MORE_STEPS + 1))
    assert [(m.step, m.value) for m in last_per_step(history)] == expected
    counts = {s: sum(m.step == s for m in history) for s, _ in expected}
    # each step once; only a call cut by the kill may have reached the store unanswered and been replayed
    assert sum(n > 1 for n in counts.values()) <= 1 and max(counts.values()) <= 2, counts
