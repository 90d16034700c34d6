"""Bitwise resume at 3 and 4 ranks, both loaders, every data-parallel strategy: a clean stop and a kill -9.

With two ranks a floating-point sum is the same in either order; from three on it is not, so only a run on 3 or
more ranks shows a resume that sums the ranks' gradients in another order than the straight run (DDP's first-step
bucket layout did, until every launch reduced each element at one offset: ``distributed.grad_buckets``).

Each case trains a straight run, then the same command as a chain of three launches in one folder:
1. stopped cleanly by SIGTERM after step 1 (a preemption: it saves step 2 and exits 0);
2. rerun, which resumes from that checkpoint, saves step 3 (``ckpt_every_steps``) and is killed with SIGKILL (the
   whole job) after step 4, whose work is lost;
3. rerun, which resumes from the newest complete checkpoint (the second launch's step 3), redoes step 4 and trains
   to the end.
Each launch's rank 0 holds itself at its step (``step_faults``), so the signals land mid-run whatever the load.
Every step's loss, ``grad_norm`` and sample ids (the last record of each step) equal the straight run's bit for bit.
Each step is two micro-batches of 4 per data-parallel rank (gradients accumulated, then exchanged once) on short
sequences: the fewest steps, rows and tokens that still take every path (a drift shows from a resumed launch's
first step on).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from automodel_ckpt.ondisk import layout
from tests.integration import step_faults
from tests.integration.harness import CKPT_TRAIN, QUIET, REPO, ckpt_train, env_for, kill_job, start_command

PRETRAIN, SFT = REPO / "recipes" / "tiny_llama_pretrain.yaml", REPO / "recipes" / "tiny_llama_sft.yaml"
MAX_STEPS, STOP_AFTER, KILL_AFTER = 5, 1, 4
COMMON = ("--step_scheduler.ckpt_every_steps", "3", "--step_scheduler.max_steps", str(MAX_STEPS),
          "--training.log_sample_ids", "true", "--checkpoint.save_consolidated", "false")
#: the pretraining recipe's streamed corpus, in sequences of 32 tokens, 8 held out
STREAMED = ("--data.shuffle_buffer", "64", "--data.seq_length", "32", "--validation_dataset.max_sequences", "8")
MAP = ("--data.val_size", "8")  # the fine-tuning recipe's map-style data


def _batch(data_parallel: int) -> tuple[str, ...]:
    """Two micro-batches of 4 rows on each of ``data_parallel`` ranks a step."""
    return ("--step_scheduler.global_batch_size", str(8 * data_parallel), "--step_scheduler.local_batch_size", "4")


BATCH3, BATCH4, BATCH_TP = _batch(3), _batch(4), _batch(2)  # tensor parallelism of 2 on 4 ranks: 2 replicas
WORKERS = {0: ("--data.num_workers", "0"), 2: ("--data.num_workers", "2")}
CASES = {  # name: (processes, recipe, keys)
    "replicate-3-streamed": (3, PRETRAIN, STREAMED + BATCH3 + WORKERS[2]),
    "replicate-3-map": (3, SFT, MAP + BATCH3 + WORKERS[0]),
    "replicate-4-streamed": (4, PRETRAIN, STREAMED + BATCH4 + WORKERS[0]),
    "replicate-4-map": (4, SFT, MAP + BATCH4 + WORKERS[2]),
    "fsdp2-3-streamed": (3, PRETRAIN, STREAMED + BATCH3 + WORKERS[0] + ("--distributed.dp_shard", "full")),
    "fsdp2-3-map": (3, SFT, MAP + BATCH3 + WORKERS[0] + ("--distributed.dp_shard", "full")),
    "hsdp-4-map": (4, SFT, MAP + BATCH4 + WORKERS[0] + ("--distributed.dp_replicate_size", "2")),
    "hsdp-4-streamed": (4, PRETRAIN, STREAMED + BATCH4 + WORKERS[0] + ("--distributed.dp_replicate_size", "2")),
    "tp-4-streamed": (4, PRETRAIN, STREAMED + BATCH_TP + WORKERS[0] + ("--distributed.tp_size", "2")),
    "tp-4-map": (4, SFT, MAP + BATCH_TP + WORKERS[0] + ("--distributed.tp_size", "2")),
}
DEADLINE_S = 300


def _steps(run_dir: Path) -> dict[int, tuple]:
    """Each step's last record in ``training.jsonl``: (loss, grad_norm, sample ids)."""
    out = {}
    for line in (run_dir / layout.TRAINING_LOG).read_text().splitlines():
        record = json.loads(line)
        out[record["step"]] = (record["loss"], record["grad_norm"], record["sample_ids"])
    return out


def _launch_until(work: Path, assets: Path, nproc: int, recipe: Path, args: tuple[str, ...], step: int,
                  stop: str) -> tuple[int, str]:
    """Start the job, its rank 0 stopping itself once step ``step`` is logged (``step_faults``); then SIGTERM the
    launcher and let rank 0 go on (``stop="term"``: a preemption at the next step boundary; wait for the exit), or
    SIGKILL the whole job (``"kill"``). Returns (exit code, output)."""
    name = args[args.index("--checkpoint.checkpoint_dir") + 1]
    log, pid_file = work / f"{name}.{stop}.log", work / f"{name}.{stop}.pid"
    cmd = [CKPT_TRAIN, "--nproc-per-node", str(nproc), str(recipe), *QUIET, *args, "--recipe", step_faults.RECIPE]
    with open(log, "w") as out:
        proc = start_command(cmd, cwd=work, env=env_for(assets, step_faults.env(step, pid_file)), stdout=out,
                             stderr=subprocess.STDOUT, start_new_session=True)
    try:
        pid = step_faults.stopped(pid_file, proc)
        assert pid is not None, f"the job ended ({proc.returncode}) before step {step}:\n" \
                                f"{log.read_text(errors='replace')[-3000:]}"
        if stop == "kill":
            kill_job(proc)
            return -signal.SIGKILL, log.read_text(errors="replace")
        os.kill(proc.pid, signal.SIGTERM)
        os.kill(pid, signal.SIGCONT)
        return proc.wait(timeout=DEADLINE_S), log.read_text(errors="replace")
    except BaseException:
        kill_job(proc)
        raise


@pytest.mark.parametrize("case", list(CASES))
def test_a_clean_stop_and_a_kill_resume_bitwise(tmp_path, assets, case):
    nproc, recipe, keys = CASES[case]
    straight = ckpt_train(tmp_path, assets, *COMMON, *keys, "--checkpoint.checkpoint_dir", "straight",
                          nproc=nproc, recipe=recipe)
    assert "Data parallelism: " in straight.output
    args = (*COMMON, *keys, "--checkpoint.checkpoint_dir", "chain")

    code, output = _launch_until(tmp_path, assets, nproc, recipe, args, STOP_AFTER, "term")
    assert code == 0, output[-3000:]
    assert f"Preempted by SIGTERM at step {STOP_AFTER + 1}: " in output, output[-3000:]
    _launch_until(tmp_path, assets, nproc, recipe, args, KILL_AFTER, "kill")
    try:
        rerun = ckpt_train(tmp_path, assets, *args, "--recipe", step_faults.RECIPE, nproc=nproc, recipe=recipe,
                           env={"PYTHONPATH": str(REPO)}, timeout=DEADLINE_S)
    except subprocess.TimeoutExpired as exc:  # what the job printed, and how far it got, say where it stood
        raise AssertionError(f"{case}: the last launch did not end in {DEADLINE_S} s; logged steps "
                             f"{sorted(_steps(tmp_path / 'chain'))}\n{str(exc.output)[-3000:]}\n"
                             f"{str(exc.stderr)[-3000:]}") from None
    assert "Loading checkpoint from chain/epoch_0_step_3" in rerun.output, rerun.output[-3000:]

    want, got = _steps(tmp_path / "straight"), _steps(tmp_path / "chain")
    assert sorted(got) == sorted(want) == list(range(1, MAX_STEPS + 1))
    for step in want:
        assert got[step] == want[step], f"{case}: step {step} differs: {got[step][:2]} != {want[step][:2]}"
