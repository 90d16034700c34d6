"""GRPO end to end (recipes/tiny_llama_grpo.yaml from the random tiny base, real `ckpt-train` launches, gloo).

Shared runs (module scope), 6 optimizer steps of 24 completions (6 prompts x 4), two passes over each rollout batch
(``grpo.num_iterations`` 2) with the k3 KL to a frozen reference, a checkpoint every 3 steps, so the step-3
checkpoint falls between the two passes over rollout batch 2. 3 processes: a sum over 2 ranks is the same in either
order, over 3 it is not, so a bitwise claim needs 3:

* ``straight``: 3 processes, 6 steps;
* ``killed``: the same, its rank 0 held mid-generation of rollout batch 3 (step 5: the first new token of each
  completion drawn) and the whole job killed (SIGKILL), then rerun: it resumes from step 3, between the two passes
  over rollout batch 2 (that batch restored with its pass index), and samples rollout batch 3 again;
* ``between``: the same, its rank 0 held after step 5 (the first of the two passes over rollout batch 3 trained and
  logged, the second not begun) and the whole job killed (SIGKILL), then rerun: it resumes from step 3 and samples
  rollout batch 3 again;
* ``resumed_on_1`` and ``resumed_on_2``: 1 and 2 processes restored from the straight run's step-3 checkpoint;
* ``poisoned``: 1 process restored from a copy of that checkpoint whose rollout batch holds a NaN advantage.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from automodel_ckpt.ondisk import layout, manifest
from tests.integration import grpo_faults, step_faults
from tests.integration.browser import needs_chromium, report_shows
from tests.integration.harness import CKPT_TRAIN, QUIET, REPO, ckpt_train, env_for, jsonl, kill_job, start_command

RECIPE = REPO / "recipes" / "tiny_llama_grpo.yaml"
NPROC = 3
ARGS = ("--dataset.num_samples", "200", "--step_scheduler.global_batch_size", "24", "--step_scheduler.local_batch_size",
        "8", "--step_scheduler.ckpt_every_steps", "3", "--step_scheduler.max_steps", "6", "--grpo.num_iterations", "2",
        "--grpo.beta", "0.04", "--grpo.num_generations", "4", "--checkpoint.save_consolidated", "false",
        # from the random base the exact answer is never found: every reward steers, normalized within each group
        "--grpo.advantage", "normalized", "--grpo.reward_weights", "[1.0,1.0,0.2]", "--optimizer.lr", "2e-4",
        "--lr_scheduler.warmup_steps", "10")
EXACT = ("loss", "reward", "reward_std", "reward_exact_answer", "reward_digits_then_eos", "kl", "clip_fraction",
         "completion_length", "completion_hash", "grpo_step", "ppo_optimization_step", "rollout_pass", "grad_norm")


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("grpo")


@pytest.fixture(scope="module")
def straight(work: Path, assets: Path) -> Path:
    ckpt_train(work, assets, *ARGS, "--checkpoint.checkpoint_dir", "straight", nproc=NPROC, recipe=RECIPE)
    return work / "straight"


def _held_and_killed(work: Path, assets: Path, name: str, hold: dict[str, str]) -> Path:
    """A run of ``ARGS`` into ``work/name`` whose rank 0 holds the job as ``hold``'s hook says, killed there
    (SIGKILL to the whole job)."""
    cmd = [CKPT_TRAIN, "--nproc-per-node", str(NPROC), str(RECIPE), *QUIET, *ARGS, "--checkpoint.checkpoint_dir", name,
           "--recipe", grpo_faults.RECIPE]
    with open(work / f"{name}.log", "w") as log:
        job = start_command(cmd, cwd=work, env=env_for(assets, hold), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        held = step_faults.stopped(Path(hold["STOP_PID_FILE"]), job)
    finally:
        kill_job(job)
    assert held is not None, (work / f"{name}.log").read_text()[-3000:]
    assert not (work / name / "epoch_0_step_6").exists()
    return work / name


@pytest.fixture(scope="module")
def killed(work: Path, assets: Path) -> tuple[Path, str]:
    # rank 0 holds the job mid-generation at step 5: step 3's checkpoint is the latest
    run = _held_and_killed(work, assets, "killed", grpo_faults.env(3, work / "stopped.pid"))
    assert [r["step"] for r in jsonl(run / "training.jsonl")] == [1, 2, 3, 4]  # step 5 never trained
    rerun = ckpt_train(work, assets, *ARGS, "--checkpoint.checkpoint_dir", "killed", nproc=NPROC, recipe=RECIPE)
    return run, rerun.output


@pytest.fixture(scope="module")
def between(work: Path, assets: Path) -> tuple[Path, str]:
    # rank 0 holds the job after step 5, between the two passes over rollout batch 3
    run = _held_and_killed(work, assets, "between", step_faults.env(5, work / "between.pid"))
    rows = jsonl(run / "training.jsonl")
    assert [(r["step"], r["grpo_step"], r["rollout_pass"]) for r in rows][-1] == (5, 3, 1)  # one pass of two taken
    rerun = ckpt_train(work, assets, *ARGS, "--checkpoint.checkpoint_dir", "between", nproc=NPROC, recipe=RECIPE)
    return run, rerun.output


def _rows(run: Path) -> list[tuple]:
    return [tuple(r[k] for k in EXACT) for r in jsonl(run / "training.jsonl")]


def test_straight_run_logs_the_rl_numbers_and_passes(straight):
    rows = jsonl(straight / "training.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [(r["grpo_step"], r["rollout_pass"]) for r in rows] == [(1, 1), (1, 2), (2, 1), (2, 2), (3, 1), (3, 2)]
    assert [r["ppo_optimization_step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    for key in ("reward", "reward_std", "reward_exact_answer", "reward_digits_then_eos", "kl", "clip_fraction",
                "completion_length", "generation_seconds", "train_seconds"):
        assert all(isinstance(r[key], float) for r in rows), key
    assert rows[0]["kl"] == 0.0 and rows[0]["clip_fraction"] == 0.0  # the first pass: policy = reference = sampler
    assert rows[1]["completion_hash"] == rows[0]["completion_hash"] != rows[2]["completion_hash"]
    assert rows[1]["generation_seconds"] == 0.0 < rows[2]["generation_seconds"]


def test_checkpoints_hold_the_counters_and_the_rollout_between_passes_and_inspect_shows_them(straight):
    meta = json.loads((straight / "epoch_0_step_3" / layout.METADATA_FILE).read_text())
    assert meta["extra"]["grpo_step"] == 2 and meta["extra"]["ppo_optimization_step"] == 3
    counters = meta["extra"]["counters"]
    assert counters["consumed_prompts"] == 12 and counters["generated_completions"] == 48
    rollout = torch.load(straight / "epoch_0_step_3" / layout.global_state_file("rollout"), weights_only=True)
    assert (rollout["step"], rollout["passes"]) == (2, 1)  # rollout batch 2, one of its two passes taken
    assert rollout["input_ids"].shape[0] == 24 and rollout["old_log_probs"].dtype == torch.float64
    assert not rollout["old_log_probs"].isnan().any()  # two passes: recorded as sampled
    grpo = torch.load(straight / "epoch_0_step_3" / layout.global_state_file("grpo"), weights_only=True)
    assert grpo["grpo_step"] == 2 and grpo["prompt_position"] == 12
    shown = subprocess.run([CKPT_TRAIN, "inspect", str(straight)], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert "epoch_0_step_3: grpo_step 2, ppo_optimization_step 3, consumed_prompts 12" in shown.stdout, shown.stdout


def test_killed_mid_generation_resumed_between_two_passes_is_bitwise(straight, killed):
    run, output = killed
    assert "Loading checkpoint from" in output and "epoch_0_step_3" in output, output[-3000:]
    assert _rows(run) == _rows(straight)
    want = json.loads((straight / "epoch_0_step_6" / layout.METADATA_FILE).read_text())["extra"]
    got = json.loads((run / "epoch_0_step_6" / layout.METADATA_FILE).read_text())["extra"]
    assert got == want


@needs_chromium
def test_the_report_of_the_killed_and_resumed_run_shows_the_grpo_panel_in_a_browser(killed, tmp_path):
    run, _ = killed
    shown = report_shows(run, tmp_path, "GRPO", "reward per function", "KL to the reference", "completion length",
                         "epoch_0_step_3", "epoch_0_step_6", "launches:")
    assert "reward_exact_answer" in shown and "started at stepresumed from0-3epoch_0_step_3" in shown, shown[:3000]


def test_killed_between_two_passes_of_one_rollout_batch_is_bitwise(straight, between):
    run, output = between
    assert "Loading checkpoint from" in output and "epoch_0_step_3" in output, output[-3000:]
    assert _rows(run) == _rows(straight)  # steps 4 to 6 again, each once: rollout batch 3 sampled the same
    want = json.loads((straight / "epoch_0_step_6" / layout.METADATA_FILE).read_text())["extra"]
    assert json.loads((run / "epoch_0_step_6" / layout.METADATA_FILE).read_text())["extra"] == want


@pytest.mark.parametrize("nproc", [1, 2])
def test_resumed_on_fewer_processes_samples_the_same_completions(work, assets, straight, nproc):
    name = f"resumed_on_{nproc}"  # 24 completions: 3 micro-batches of 8 on one process, 3 of 4 on each of two
    ckpt_train(work, assets, *ARGS, "--step_scheduler.local_batch_size", str(8 // nproc), "--checkpoint.checkpoint_dir",
               name, "--checkpoint.restore_from", str(straight / "epoch_0_step_3"), nproc=nproc, recipe=RECIPE)
    got, want = jsonl(work / name / "training.jsonl"), jsonl(straight / "training.jsonl")[3:]
    assert [r["step"] for r in got] == [4, 5, 6]
    for key in ("completion_hash", "reward", "grpo_step", "ppo_optimization_step", "rollout_pass"):
        assert [r[key] for r in got] == [r[key] for r in want], key
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-5, abs=1e-7)


def test_started_from_an_sft_checkpoint_its_reference_is_those_weights(work, assets):
    """The recipe's intended start: an SFT run's weights (``restore_from`` + ``load_only: [model]``), this run's own
    counters; the frozen reference is the policy as loaded (no KL at the first pass), not the random base."""
    ckpt_train(work, assets, "--dataset.num_samples", "200", "--data.val_size", "0", "--step_scheduler.max_steps",
               "2", "--step_scheduler.ckpt_every_steps", "2", "--step_scheduler.global_batch_size", "16",
               "--step_scheduler.local_batch_size", "8", "--checkpoint.save_consolidated", "false",
               "--checkpoint.checkpoint_dir", "sft", nproc=2, recipe=REPO / "recipes" / "tiny_llama_sft.yaml")
    sft = work / "sft" / "epoch_0_step_2"
    ckpt_train(work, assets, *ARGS, "--step_scheduler.max_steps", "2", "--step_scheduler.ckpt_every_steps", "2",
               "--step_scheduler.global_batch_size", "16", "--checkpoint.checkpoint_dir", "from_sft", "--checkpoint.restore_from", str(sft),
               "--checkpoint.load_only", "[model]", nproc=2, recipe=RECIPE)
    rows = jsonl(work / "from_sft" / "training.jsonl")
    assert [(r["step"], r["grpo_step"], r["rollout_pass"]) for r in rows] == [(1, 1, 1), (2, 1, 2)]
    assert rows[0]["kl"] == 0.0 and rows[1]["kl"] > 0.0
    meta = json.loads((work / "from_sft" / "epoch_0_step_2" / layout.METADATA_FILE).read_text())
    assert (meta["extra"]["grpo_step"], meta["extra"]["ppo_optimization_step"]) == (1, 2)
    assert (work / "from_sft" / "epoch_0_step_2" / "ref_model").exists()


def test_a_received_checkpoint_whose_rollout_holds_a_nan_advantage_is_refused_in_one_line(work, assets, straight):
    """A copy of the step-3 checkpoint, its rollout batch given a NaN advantage and the manifest rewritten to match
    (as anyone who rewrites a checkpoint can): restored from, it is refused in one line naming the file and the
    field, exit 3, before any step is trained or saved (the NaN once trained and its weights were saved, exit 0).
    Every other field and value: tests/hostile/test_grpo_state_inputs.py."""
    source = work / "poisoned_source" / "epoch_0_step_3"
    shutil.copytree(straight / "epoch_0_step_3", source, symlinks=True)
    file = source / layout.global_state_file("rollout")
    state = torch.load(file, weights_only=True)
    state["advantages"][5] = float("nan")
    torch.save(state, file)
    manifest.seal(source, 0, 1)
    result = ckpt_train(work, assets, *ARGS, "--step_scheduler.local_batch_size", "8", "--checkpoint.checkpoint_dir",
                        "poisoned", "--checkpoint.restore_from", str(source), nproc=1, recipe=RECIPE, check=False)
    errors = [line for line in result.output.splitlines() if "error:" in line]
    assert result.returncode == 3 and "Traceback" not in result.output, result.output[-3000:]
    assert errors == [f"error: '{file}': the GRPO rollout batch: 'advantages' holds nan in row 5: an advantage is "
                      "finite, at most 2 in size (the square root of a group of 4)"], result.output[-3000:]
    assert not list((work / "poisoned").glob("epoch_*"))
