"""Runs that change shape (docs/stages.md): a 3-stage streamed run (a batch change and a new source, then a longer
sequence and a cooldown) planned, killed inside stage 2 and rerun, and decided at resumes, the same steps bit for
bit; a map-style epoch trained once across a batch and world-size change. One module-scoped set of short runs of the
tiny model on 2 and 3 processes."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from automodel_ckpt.ondisk import CheckpointFolder, RunFolder
from tests.integration import step_faults
from tests.integration.harness import (CKPT_TRAIN, QUIET, RECIPE, ckpt_train, env_for, jsonl, kill_job, run_command,
                                       start_command)
from tests.integration.trackers import tensorboard_scalars, tensorboard_texts

ARGS = ("--checkpoint.save_consolidated", "false", "--training.log_sample_ids", "true", "--data.val_size", "32",
        "--step_scheduler.val_every_steps", "100", "--step_scheduler.ckpt_every_steps", "100",
        "--step_scheduler.local_batch_size", "8", "--step_scheduler.global_batch_size", "48",
        "--step_scheduler.max_steps", "8")
COOLDOWN = {"_target_": "automodel_ckpt.training.lr.cooldown", "steps": 3, "final_lr": 0.0}
STAGES = [{"name": "big", "at_step": 3, "set": {"step_scheduler.global_batch_size": 96}},
          {"name": "anneal", "at_step": 6, "set": {"data.seq_length": 24, "lr_scheduler": COOLDOWN}}]
BIG = ("--step_scheduler.global_batch_size", "96")
PRETRAIN = RECIPE.parent / "tiny_llama_pretrain.yaml"
STREAM = ("--checkpoint.save_consolidated", "false", "--training.log_sample_ids", "true",
          "--step_scheduler.val_every_steps", "100", "--step_scheduler.ckpt_every_steps", "100",
          "--step_scheduler.global_batch_size", "8", "--step_scheduler.local_batch_size", "4",
          "--step_scheduler.max_steps", "10")
BLEND = [{"path": "A/*.jsonl", "weight": 0.7}, {"path": "B/*.jsonl", "weight": 0.3}]
STREAM_STAGES = [{"name": "mix", "at_step": 3, "set": {"step_scheduler.global_batch_size": 16,
                                                      "dataset.sources": BLEND}},
                 {"name": "anneal", "at_step": 7, "set": {"data.seq_length": 48, "lr_scheduler": COOLDOWN}}]
MIX = ("--step_scheduler.global_batch_size", "16", "--dataset.sources", json.dumps(BLEND))
LONGER = ("--data.seq_length", "48", "--lr_scheduler", json.dumps(COOLDOWN))


def _planned(work: Path) -> Path:
    recipe = yaml.safe_load(RECIPE.read_text()) | {"stages": STAGES}
    (work / "staged.yaml").write_text(yaml.safe_dump(recipe))
    return work / "staged.yaml"


def _steps(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in jsonl(RunFolder(run).training_log)}


def _corpus(work: Path) -> tuple[Path, Path]:
    """Two small sources of json-lines documents (A and B) and the pretraining recipe reading A alone."""
    rng = random.Random(0)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho".split()
    for source, files in (("A", 6), ("B", 4)):
        (work / source).mkdir()
        for f in range(files):
            (work / source / f"part{f}.jsonl").write_text("".join(
                json.dumps({"text": f"{source} " + " ".join(rng.choice(words) for _ in range(rng.randint(2, 10)))})
                + "\n" for _ in range(60)))
    recipe = yaml.safe_load(PRETRAIN.read_text())
    recipe |= {"dataset": {"_target_": "automodel_ckpt.data.stream.corpus.streamed_corpus",
                           "sources": [{"path": "A/*.jsonl"}]},
               "validation_dataset": None, "lr_scheduler": {"_target_": "automodel_ckpt.training.lr.wsd",
                                                            "warmup_steps": 2}}
    recipe["data"] |= {"seq_length": 32, "shuffle_buffer": 64, "num_workers": 0, "lanes": 2}
    (work / "stream.yaml").write_text(yaml.safe_dump(recipe))
    (work / "stream_staged.yaml").write_text(yaml.safe_dump(recipe | {"stages": STREAM_STAGES}))
    return work / "stream.yaml", work / "stream_staged.yaml"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, assets):
    """Map-style: the planned run (tracked by TensorBoard); a batch of 48 on 2 processes going on at 96 on 3 (first
    refused without --checkpoint.new_stage). Streamed: a 3-stage run planned, the same killed inside stage 2 and
    rerun, and the plan decided at resumes in three launches."""
    work = tmp_path_factory.mktemp("stages")
    staged = _planned(work)
    out = {"work": work}
    out["planned"] = ckpt_train(work, assets, *ARGS, "--checkpoint.checkpoint_dir", "planned",
                                "--logging.tensorboard", "{}", recipe=staged, nproc=2)
    # its two newest checkpoints damaged: one of stage main resumes, and the run is built again for the next stage
    shutil.copytree(work / "planned", work / "healed", symlinks=True)
    for step in (6, 8):
        for shard in (work / "healed" / f"epoch_0_step_{step}" / "model").glob("*.safetensors"):
            shard.write_bytes(shard.read_bytes()[:100])
    out["healed"] = ckpt_train(work, assets, *ARGS, "--checkpoint.checkpoint_dir", "healed", recipe=staged, nproc=2)
    resized = (*ARGS, "--checkpoint.checkpoint_dir", "resized")
    ckpt_train(work, assets, *resized, "--step_scheduler.max_steps", "2", nproc=2)
    out["refused"] = ckpt_train(work, assets, *resized, *BIG, "--step_scheduler.max_steps", "4", nproc=3,
                                check=False)
    out["resized"] = ckpt_train(work, assets, *resized, *BIG, "--step_scheduler.max_steps", "4",
                                "--checkpoint.new_stage", "big", nproc=3)
    plain, streamed = _corpus(work)
    ckpt_train(work, assets, *STREAM, "--checkpoint.checkpoint_dir", "s_planned", recipe=streamed, nproc=2)
    cmd = [CKPT_TRAIN, "--nproc-per-node", "2", str(streamed), *QUIET, *STREAM, "--checkpoint.checkpoint_dir",
           "s_killed", "--step_scheduler.ckpt_every_steps", "2", "--recipe", step_faults.RECIPE]
    pid_file = work / "stopped.pid"  # held after step 5: stage 'mix' began at step 4, its step 4 is saved
    with open(work / "killed.log", "w") as log:
        job = start_command(cmd, cwd=work, env=env_for(assets, step_faults.env(5, pid_file)), stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out["held"] = step_faults.stopped(pid_file, job)
    finally:
        kill_job(job)  # kill -9 of every process of the job
    out["killed_saved"] = sorted(p.name for p in (work / "s_killed").glob("epoch_*"))
    out["rerun"] = ckpt_train(work, assets, *STREAM, "--checkpoint.checkpoint_dir", "s_killed", recipe=streamed,
                              nproc=2)
    decided = (*STREAM, "--checkpoint.checkpoint_dir", "s_decided")
    ckpt_train(work, assets, *decided, "--step_scheduler.max_steps", "3", recipe=plain, nproc=2)
    ckpt_train(work, assets, *decided, *MIX, "--step_scheduler.max_steps", "7", "--checkpoint.new_stage", "mix",
               recipe=plain, nproc=2)
    ckpt_train(work, assets, *decided, *MIX, *LONGER, "--checkpoint.new_stage", "anneal", recipe=plain, nproc=2)
    return out


def test_a_planned_run_saves_where_each_stage_begins_and_names_it_at_every_step(runs):
    run = runs["work"] / "planned"
    steps = _steps(run)
    assert [steps[s]["stage"] for s in range(1, 9)] == ["main"] * 3 + ["big"] * 3 + ["anneal"] * 2
    assert [len(steps[s]["sample_ids"]) for s in range(1, 9)] == [48] * 3 + [96] * 5
    ids = [i for s in range(1, 9) for i in steps[s]["sample_ids"]]
    assert len(ids) == len(set(ids)) == 3 * 48 + 5 * 96  # no sample of epoch 0 twice
    assert {p.name for p in run.glob("epoch_*")} == {"epoch_0_step_3", "epoch_0_step_6", "epoch_0_step_8"}
    # the anneal stage's cooldown: from the lr in force at its first step to 0 over 3 steps
    assert steps[8]["lr"] == pytest.approx(steps[7]["lr"] * 2 / 3)
    meta = json.loads((CheckpointFolder(run / "epoch_0_step_8").metadata).read_text())
    assert [(s["name"], s["first_step"], s["samples"], s["changed"]) for s in meta["stages"]] == [
        ("main", 1, 0, []), ("big", 4, 144, ["step_scheduler.global_batch_size"]),
        ("anneal", 7, 432, ["data.seq_length", "lr_scheduler"])]
    assert meta["stages"][2]["lr"] == steps[7]["lr"] and meta["stages"][2]["schedule"] == {"from": 6, "steps": 2}
    tokens = [s["tokens"] for s in meta["stages"]]
    assert tokens[0] == 0 < tokens[1] < tokens[2] < meta["consumed_tokens"]
    boundary = json.loads((CheckpointFolder(run / "epoch_0_step_3").metadata).read_text())
    assert [s["name"] for s in boundary["stages"]] == ["main"]  # saved before the stage began
    assert "Stage 'big' begins at step 4" in runs["planned"].stdout


def test_the_trackers_get_the_stage_at_every_step_and_where_each_begins(runs):
    board = runs["work"] / "planned" / "tensorboard"
    assert tensorboard_scalars(board, "train/stage") == [(s, float(i)) for s, i in
                                                         zip(range(1, 9), [0, 0, 0, 1, 1, 1, 2, 2])]
    texts = " ".join(text for _, _, text in tensorboard_texts(board))
    assert "stage 'big' begins at step 4" in texts and "stage 'anneal' begins at step 7" in texts


def test_a_streamed_run_planned_in_three_stages_counts_each_source_from_its_boundary(runs):
    steps = _steps(runs["work"] / "s_planned")
    assert [steps[s]["stage"] for s in range(1, 11)] == ["main"] * 3 + ["mix"] * 4 + ["anneal"] * 3
    assert [len(steps[s]["sample_ids"]) for s in range(1, 11)] == [8] * 3 + [16] * 7
    ids = [i for s in range(1, 11) for i in steps[s]["sample_ids"]]
    assert len(ids) == len(set(ids))  # no sequence trained twice
    assert [len(steps[s]["source_tokens"]) for s in range(1, 11)] == [1] * 3 + [2] * 7  # B is a source from step 4
    assert steps[7]["source_tokens"][1] > 0  # and its documents are trained in the mix stage
    tokens = [sum(steps[s]["source_tokens"]) for s in range(1, 11)]
    assert [b - a for a, b in zip([0, *tokens], tokens)] == [8 * 32] * 3 + [16 * 32] * 4 + [16 * 48] * 3
    meta = json.loads((CheckpointFolder(runs["work"] / "s_planned" / "epoch_0_step_10").metadata).read_text())
    assert [(s["name"], s["first_step"], s["samples"], s["tokens"]) for s in meta["stages"]] == [
        ("main", 1, 0, 0), ("mix", 4, 24, 24 * 32), ("anneal", 8, 88, 24 * 32 + 64 * 32)]
    assert meta["extra"]["data_position"]["sequences"] == 136


def test_a_streamed_run_killed_inside_stage_2_and_rerun_gives_the_planned_steps_bit_for_bit(runs):
    assert runs["held"] is not None, (runs["work"] / "killed.log").read_text()[-3000:]
    assert runs["killed_saved"] == ["epoch_0_step_2", "epoch_0_step_3", "epoch_0_step_4"]
    assert "Loading checkpoint from s_killed/epoch_0_step_4" in runs["rerun"].stdout
    planned, rerun = _steps(runs["work"] / "s_planned"), _steps(runs["work"] / "s_killed")
    assert sorted(rerun) == list(range(1, 11))
    for step in range(1, 11):
        for key in ("loss", "sample_ids", "lr", "stage", "source_tokens"):
            assert rerun[step][key] == planned[step][key], (step, key)


def test_the_plan_decided_at_resumes_in_three_launches_gives_the_planned_steps_bit_for_bit(runs):
    planned, decided = _steps(runs["work"] / "s_planned"), _steps(runs["work"] / "s_decided")
    assert sorted(decided) == list(range(1, 11))
    for step in range(1, 11):
        for key in ("loss", "sample_ids", "lr", "source_tokens"):
            assert decided[step][key] == planned[step][key], (step, key)
    assert [decided[s].get("stage") for s in range(1, 11)] == [None] * 3 + ["mix"] * 4 + ["anneal"] * 3
    meta = json.loads((CheckpointFolder(runs["work"] / "s_decided" / "epoch_0_step_10").metadata).read_text())
    assert [(s["name"], s["first_step"], s["samples"], s["changed"]) for s in meta["stages"]] == [
        ("main", 1, 0, []), ("mix", 4, 24, ["dataset.sources", "step_scheduler.global_batch_size"]),
        ("anneal", 8, 88, ["data.seq_length", "lr_scheduler"])]


def test_a_batch_of_48_on_2_processes_goes_on_at_96_on_3_with_no_sample_of_the_epoch_twice(runs):
    refused = runs["refused"]
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert refused.returncode != 0 and errors, refused.output[-2000:]
    assert "recipe key 'step_scheduler.global_batch_size' is 48 there, 96 here" in errors[0]
    assert "--checkpoint.new_stage NAME" in errors[0]
    assert "Stage 'big' begins at step 3" in runs["resized"].stdout
    assert "Resuming at world size 3 (checkpoint written by 2)" in runs["resized"].stdout
    planned, resized = _steps(runs["work"] / "planned"), _steps(runs["work"] / "resized")
    assert [len(resized[s]["sample_ids"]) for s in range(1, 5)] == [48, 48, 96, 96]
    ids = [i for s in range(1, 5) for i in resized[s]["sample_ids"]]
    assert len(ids) == len(set(ids))
    # the next 96 samples of the epoch's order, whatever the batch before: the planned run's, cut another way
    order = [i for s in range(1, 6) for i in planned[s]["sample_ids"]]
    assert ids == order[:len(ids)]


def test_inspect_lists_the_stages_of_a_checkpoint(runs):
    shown = run_command([CKPT_TRAIN, "inspect", str(runs["work"] / "planned")], cwd=runs["work"], timeout=120)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    at = lines.index(next(line for line in lines if line.startswith("stages at epoch_0_step_8 (step 8, ")))
    assert lines[at + 1].startswith("  main: from step 1 (after 0 samples, 0 tokens): the recipe as written")
    assert lines[at + 2].startswith("  big: from step 4 (after 144 samples, ")
    assert lines[at + 3].endswith(": data.seq_length, lr_scheduler")


def test_diff_and_lineage_name_a_stage_change_between_two_checkpoints(runs):
    run = runs["work"] / "planned"
    diff = run_command([CKPT_TRAIN, "diff", str(run / "epoch_0_step_6"), str(run / "epoch_0_step_8")],
                       cwd=runs["work"], timeout=120)
    assert diff.returncode == 1, diff.stderr  # different weights
    assert "  stage: 'big (from step 4)' -> 'anneal (from step 7)'" in diff.stdout.splitlines()
    assert "  data.seq_length: 16 -> 24" in diff.stdout.splitlines()
    lineage = run_command([CKPT_TRAIN, "inspect", "--lineage", str(run / "epoch_0_step_8")], cwd=runs["work"],
                          timeout=120)
    lines = [line.strip() for line in lineage.stdout.splitlines()]
    assert lines[1] == "stage: anneal (from step 7, after stage big of its parent: a stage change)"
    assert "stage: big (from step 4, after stage main of its parent: a stage change)" in lines
    assert "stage: main (from step 1)" in lines


def test_a_resume_that_falls_back_to_an_earlier_stage_is_built_again_for_it(runs):
    healed = runs["healed"].stdout
    assert healed.count("moved it to") == 2 and "Loading checkpoint from healed/epoch_0_step_3" in healed
    assert "Stage 'big' begins at step 4" in healed and "Stage 'anneal' begins at step 7" in healed
    planned, again = _steps(runs["work"] / "planned"), _steps(runs["work"] / "healed")
    for step in range(1, 9):
        assert (again[step]["loss"], again[step]["sample_ids"], again[step]["stage"]) == \
               (planned[step]["loss"], planned[step]["sample_ids"], planned[step]["stage"]), step
