"""GRPO with ``grpo.engine vllm`` (a vLLM server process samples; real `ckpt-train` launches on 2 processes, gloo).

Needs ``.venv-vllm`` (``bash tools/setup.sh --with-vllm``): skipped without it, failed without it under ``CI=true``
(CI builds it). Shared runs (module scope) of the tiny Llama from its random base, 4 steps of 32 completions (8
prompts x 4), one pass per rollout batch, a checkpoint every 2 steps, every reward steering (so the weights move):

* ``straight``: 4 steps;
* ``killed``: rank 0 stopped as it asks the engine for rollout batch 3 (weights pushed, nothing sampled), killed
  alone with SIGKILL (its engine must die with it), the rest of the job killed, then rerun: it resumes from step 2,
  pushes the restored weights to a new engine, checks them and samples rollout batches 3 and 4 again.

The rerun also loses its engine as it asks for rollout batch 3 (restarted once, step 3 trains), then twice as it asks
for batch 4 (its restarted engine too): it stops in one line after saving step 3, and a last launch trains step 4.
Beside them: a LoRA run of 2 steps on an engine named by URL (the adapter pushed alone), and a run whose engine
cannot start.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from automodel_ckpt.ondisk import layout
from tests.integration import grpo_faults, step_faults
from tests.integration.harness import CKPT_TRAIN, QUIET, REPO, ckpt_train, env_for, jsonl, kill_job, process_tree, \
    start_command

RECIPE = REPO / "recipes" / "tiny_llama_grpo.yaml"
ENGINE_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
ARGS = ("--grpo.engine", "vllm", "--dataset.num_samples", "200", "--step_scheduler.global_batch_size", "32",
        "--step_scheduler.local_batch_size", "16", "--step_scheduler.ckpt_every_steps", "2",
        "--step_scheduler.max_steps", "4", "--grpo.num_generations", "4", "--checkpoint.save_consolidated", "false",
        "--grpo.advantage", "normalized", "--grpo.reward_weights", "[1.0,1.0,0.2]", "--lr_scheduler.warmup_steps", "0")
EXACT = ("loss", "reward", "grad_norm", "completion_hash", "grpo_step", "ppo_optimization_step", "weight_version",
         "weight_hash", "engine_weight_hash")

if not ENGINE_PYTHON.is_file():
    reason = f"no {ENGINE_PYTHON.relative_to(REPO)}: build it with `bash tools/setup.sh --with-vllm`"
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI builds the vLLM environment, and it is missing: {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("grpo_vllm")


@pytest.fixture(scope="module")
def straight(work: Path, assets: Path) -> tuple[Path, float]:
    start = time.monotonic()
    ckpt_train(work, assets, *ARGS, "--checkpoint.checkpoint_dir", "straight", nproc=2, recipe=RECIPE)
    return work / "straight", time.monotonic() - start


def _engines(pid: int) -> list[int]:
    """The vLLM engine processes among ``pid``'s descendants."""
    found = []
    for p in process_tree(pid):
        try:
            if b"vllm_server.py" in Path(f"/proc/{p}/cmdline").read_bytes():
                found.append(p)
        except OSError:
            pass
    return found


def _gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def killed(work: Path, assets: Path) -> tuple[Path, str, bool]:
    pid_file = work / "stopped.pid"
    cmd = [CKPT_TRAIN, "--nproc-per-node", "2", str(RECIPE), *QUIET, *ARGS, "--checkpoint.checkpoint_dir", "killed",
           "--recipe", grpo_faults.RECIPE]
    with open(work / "killed.log", "w") as log:
        job = start_command(cmd, cwd=work, env=env_for(assets, grpo_faults.env(3, pid_file)), stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        held = step_faults.stopped(pid_file, job)
        assert held is not None, (work / "killed.log").read_text()[-3000:]
        rank0 = int(pid_file.read_text())
        engines = _engines(rank0)
        assert len(engines) == 1, engines
        os.kill(rank0, signal.SIGKILL)  # rank 0 alone: its engine must not outlive it
        engine_died = _gone(engines[0], 30)
    finally:
        kill_job(job)
    run = work / "killed"
    assert [r["step"] for r in jsonl(run / "training.jsonl")] == [1, 2]
    rerun = ckpt_train(work, assets, *ARGS, "--checkpoint.checkpoint_dir", "killed", "--recipe", grpo_faults.RECIPE,
                       nproc=2, recipe=RECIPE, check=False, env={"KILL_ENGINE_IN_ROLLOUT": "3,4,4",
                                                                 **grpo_faults.env(0, work / "never.pid")})
    last = ckpt_train(work, assets, *ARGS, "--checkpoint.checkpoint_dir", "killed", nproc=2, recipe=RECIPE)
    return run, rerun, last.output, engine_died


def test_each_step_records_the_weights_that_sampled_it_and_the_engine_holds_the_trainers(straight):
    run, seconds = straight
    rows = jsonl(run / "training.jsonl")
    assert [(r["step"], r["grpo_step"], r["weight_version"]) for r in rows] == [(1, 1, 0), (2, 2, 1), (3, 3, 2),
                                                                                (4, 4, 3)]
    assert all(r["weight_hash"] == r["engine_weight_hash"] for r in rows)
    assert len({r["weight_hash"] for r in rows}) == 4  # the weights moved at every step, and each reached the engine
    assert all(r["sync_bytes"] > 0 and r["sync_seconds"] > 0 and 0 < r["sync_ratio"] < 1 for r in rows)
    print(f"straight run of 4 steps with the engine: {seconds:.1f} s")


def test_killed_mid_rollout_the_rerun_pushes_the_restored_weights_and_continues_as_the_straight_run(straight, killed):
    """The rerun also loses its engine (SIGKILL from rank 0) as it asks for rollout batch 3: it starts a new engine,
    pushes every weight again and asks again with the same seeds. Lost twice as it asks for batch 4, it stops in one
    line after saving step 3 (its counters and batch as that step ended), and the next launch trains step 4. Every
    step still equals the straight run's: no rollout lost or counted twice."""
    run, rerun, output, engine_died = killed
    assert engine_died, "the engine outlived its trainer (rank 0 killed with SIGKILL)"
    assert "Loading checkpoint from" in rerun.output and "epoch_0_step_2" in rerun.output, rerun.output[-3000:]
    assert "restarting the engine (once), rollout batch 3 asked again" in rerun.output, rerun.output[-3000:]
    assert "restarting the engine (once), rollout batch 4 asked again" in rerun.output, rerun.output[-3000:]
    assert rerun.returncode == 2 and "Traceback" not in rerun.output, rerun.output[-3000:]
    errors = [line for line in rerun.stderr.splitlines() if line.startswith("error:")]
    assert errors[0].startswith("error: the vLLM engine at") and len(errors) == 2, errors  # and the launcher's line
    assert "Loading checkpoint from" in output and "epoch_0_step_3" in output, output[-3000:]  # saved as it stopped
    got, want = jsonl(run / "training.jsonl"), jsonl(straight[0] / "training.jsonl")
    assert [r["step"] for r in got] == [1, 2, 3, 4]  # steps 3 and 4 once each, after the resume
    assert got[3]["sync_bytes"] == got[0]["sync_bytes"]  # the new engine got every weight again
    # counters, prompts, weight versions and hashes, and the completions (vLLM is batch invariant here: docs/rl.md)
    assert [tuple(r[k] for k in EXACT) for r in got] == [tuple(r[k] for k in EXACT) for r in want]
    for name in ("grpo", "rollout"):  # the final checkpoints' counters and rollout batch, bit for bit
        a, b = (torch.load(r / "epoch_0_step_4" / layout.global_state_file(name), weights_only=True)
                for r in (run, straight[0]))
        assert a.keys() == b.keys(), name
        for key in a:
            same = a[key].numpy().tobytes() == b[key].numpy().tobytes() if isinstance(a[key], torch.Tensor) \
                else a[key] == b[key]  # bytes: NaN (log-probs not recorded at one pass) equals itself
            assert same, (name, key)


@pytest.fixture(scope="module")
def ahead(work: Path, assets: Path) -> tuple[Path, Path, Any]:
    """``grpo.max_staleness 2``: a straight run, and one whose rank 0 stops as step 4 trains (step 3 trained and
    logged, rollout batch 6 being sampled ahead), killed there (SIGKILL) and rerun: it resumes from step 2, whose
    checkpoint holds rollout batches 3 and 4 (sampled, not trained). The rerun loses its engine as step 3 asks for
    batch 5 ahead, and its restarted engine too: it saves step 3 and stops."""
    more = ("--grpo.max_staleness", "2")
    ckpt_train(work, assets, *ARGS, *more, "--checkpoint.checkpoint_dir", "ahead", nproc=2, recipe=RECIPE)
    pid_file = work / "ahead_stopped.pid"
    cmd = [CKPT_TRAIN, "--nproc-per-node", "2", str(RECIPE), *QUIET, *ARGS, *more, "--checkpoint.checkpoint_dir",
           "ahead_killed", "--recipe", grpo_faults.RECIPE]
    with open(work / "ahead_killed.log", "w") as log:
        job = start_command(cmd, cwd=work, env=env_for(assets, step_faults.env(3, pid_file)), stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        assert step_faults.stopped(pid_file, job) is not None, (work / "ahead_killed.log").read_text()[-3000:]
    finally:
        kill_job(job)
    assert [r["step"] for r in jsonl(work / "ahead_killed" / "training.jsonl")] == [1, 2, 3]
    lost = ckpt_train(work, assets, *ARGS, *more, "--checkpoint.checkpoint_dir", "ahead_killed", "--recipe",
                      grpo_faults.RECIPE, nproc=2, recipe=RECIPE, check=False,
                      env={"KILL_ENGINE_AHEAD": "5,5", **grpo_faults.env(0, work / "never.pid")})
    return work / "ahead", work / "ahead_killed", lost


def test_sampling_two_steps_ahead_lags_two_versions_and_resumes_on_the_checkpointed_batches(ahead):
    straight, rerun, _ = ahead
    rows = jsonl(straight / "training.jsonl")
    # batches 1-3 sampled by version 0 (1 as the run starts, 2 before step 1 trains, 3 while it trains), then batch
    # n + 2 by the weights step n trains from: the lag grows to 2 and stays
    assert [(r["grpo_step"], r["weight_version"], r["weight_lag"]) for r in rows] == [(1, 0, 0), (2, 0, 1), (3, 0, 2),
                                                                                      (4, 1, 2)]
    assert all(r["rollout_wait_seconds"] >= 0 and r["weight_hash"] == r["engine_weight_hash"] for r in rows)
    assert rows[0]["weight_hash"] == rows[1]["weight_hash"] == rows[2]["weight_hash"] != rows[3]["weight_hash"]
    for name, expected in (("next_rollout", (3, 0, 0)), ("next_rollout_2", (4, 0, 1))):
        held = torch.load(straight / "epoch_0_step_2" / layout.global_state_file(name), weights_only=True)
        assert (held["step"], held["passes"], held["weight_version"]) == expected, name
        assert not held["old_log_probs"].isnan().any()  # the engine's log-probs as sampled: the ratio's denominator
    keys = EXACT + ("weight_lag",)
    # the rerun trained rollout batch 3 from the checkpoint, as the straight run did (then stopped: the next test)
    assert [tuple(r[k] for k in keys) for r in jsonl(rerun / "training.jsonl")] == [tuple(r[k] for k in keys)
                                                                                      for r in rows[:3]]


def test_an_engine_lost_twice_as_a_batch_is_asked_ahead_saves_that_step_and_no_prompt_is_lost(ahead):
    """Step 3 trained, the engine killed as batch 5 is asked ahead, restarted and killed again: the run gives batch
    5's prompts back, leaves its slot empty, saves step 3 and stops in one line. That checkpoint holds batch 4 as
    the straight run sampled it, and has taken the prompts the straight run had after batch 4: a resume samples
    batch 5 from the same prompts (none skipped, none taken twice)."""
    straight, rerun, lost = ahead
    assert "restarting the engine (once), rollout batch 5 asked again" in lost.output, lost.output[-3000:]
    assert lost.returncode == 2 and "Traceback" not in lost.output, lost.output[-3000:]
    errors = [line for line in lost.stderr.splitlines() if line.startswith("error:")]
    assert errors[0].startswith("error: the vLLM engine at") and len(errors) == 2, errors  # and the launcher's line

    def held(run: Path, step: int, name: str) -> dict:
        return torch.load(run / f"epoch_0_step_{step}" / layout.global_state_file(name), weights_only=True)

    assert held(rerun, 3, "next_rollout_2")["step"] == 0, "batch 5's slot left empty"
    kept, sampled = held(rerun, 3, "next_rollout"), held(straight, 2, "next_rollout_2")
    assert kept.keys() == sampled.keys() and kept["step"] == 4
    assert all(kept[k].numpy().tobytes() == sampled[k].numpy().tobytes() if isinstance(kept[k], torch.Tensor)
               else kept[k] == sampled[k] for k in kept)  # bit for bit, the log-probs as sampled included
    a, b = held(rerun, 3, "grpo"), held(straight, 2, "grpo")
    assert (a["grpo_step"], a["ppo_optimization_step"]) == (4, 3)
    assert {k: v for k, v in a.items() if "prompt" in k} == {k: v for k, v in b.items() if "prompt" in k}


def test_a_lora_run_on_an_engine_named_by_url_pushes_the_base_once_then_only_its_adapter(work, assets):
    """``grpo.vllm.url``: an engine started by hand (the same server) gets the weights and samples; the run neither
    starts another nor stops it. ``peft:``: the engine gets the base's weights at the first push, then the adapter
    alone (a PEFT adapter folder, sampled with as a vLLM LoRA request): each later push is the adapter's bytes, its
    hash the engine's."""
    from safetensors import safe_open

    folder = work / "by_hand"
    folder.mkdir()
    (folder / "config.json").write_text((assets / "tiny_llama_base" / "config.json").read_text())
    server = subprocess.Popen([str(ENGINE_PYTHON), str(REPO / "automodel_ckpt" / "algorithms" / "grpo" /
                                                        "vllm_server.py"), "--model-dir", str(folder),
                               "--max-model-len", "16", "--lora-rank", "8", "--port-file", str(folder / "port")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (folder / "port").exists() and server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        url = f"http://127.0.0.1:{(folder / 'port').read_text()}"
        ckpt_train(work, assets, *ARGS, "--grpo.vllm.url", url, "--peft.rank", "8", "--step_scheduler.max_steps", "2",
                   "--checkpoint.checkpoint_dir", "lora", nproc=2, recipe=RECIPE)
        assert server.poll() is None  # still serving
    finally:
        server.kill()
        server.wait()
    rows = jsonl(work / "lora" / "training.jsonl")
    with safe_open(str(work / "lora" / "epoch_0_step_2" / "model" / "adapter_model.safetensors"), "pt") as f:
        adapter = sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())
    assert [r["weight_version"] for r in rows] == [0, 1]
    assert rows[0]["sync_bytes"] > 10 * adapter and rows[1]["sync_bytes"] == adapter, (rows, adapter)
    assert all(r["weight_hash"] == r["engine_weight_hash"] for r in rows) and rows[0]["weight_hash"] != rows[1][
        "weight_hash"]


def test_an_engine_that_cannot_serve_the_model_is_one_line_before_training(work, assets):
    """The product's own Python has no vLLM: the engine exits at once, and the run stops in one line naming it
    before any step."""
    import sys

    result = ckpt_train(work, assets, *ARGS, "--grpo.vllm.python", sys.executable, "--checkpoint.checkpoint_dir",
                        "no_vllm", nproc=1, recipe=RECIPE, check=False)
    errors = [line for line in result.output.splitlines() if "error:" in line]
    assert result.returncode == 2 and "Traceback" not in result.output, result.output[-3000:]
    assert len(errors) == 1 and "grpo.engine vllm: the engine exited (2): vLLM (not installed) cannot serve" in \
        errors[0] and "ModuleNotFoundError" in errors[0], errors
    assert not (work / "no_vllm" / "training.jsonl").exists() or not jsonl(work / "no_vllm" / "training.jsonl")
