"""training.ema_decay end to end: killed and rerun, bitwise; resumed on 1 process from 2, bitwise; exported as HF."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from automodel_ckpt.export import consolidate
from automodel_ckpt.ondisk import CheckpointFolder, layout
from tests.integration import step_faults
from tests.integration.harness import (CKPT_TRAIN, QUIET, RECIPE, ckpt_train, env_for, kill_job, losses,
                                       run_command, start_command)

DECAY = "0.75"  # large enough a step's weight that a wrong average shows in every tensor
ARGS = ("--checkpoint.save_consolidated", "false", "--step_scheduler.ckpt_every_steps", "4", "--data.val_size", "64",
        "--training.ema_decay", DECAY)


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def _ema(ckpt: Path, out: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's EMA weights, whole, in float32: its ema/ shards exported as a Hugging Face folder."""
    return _tensors(consolidate(CheckpointFolder(ckpt).ema.path, out, cast_dtype="fp32", progress=False,
                                metadata_dir=CheckpointFolder(ckpt).model.path))


def _model(ckpt: Path, out: Path) -> dict[str, torch.Tensor]:
    return _tensors(consolidate(CheckpointFolder(ckpt).model.path, out, cast_dtype="fp32", progress=False))


@pytest.fixture(scope="module")
def straight(tmp_path_factory, assets) -> Path:
    """An EMA run of 8 steps on 2 processes (checkpoints at steps 4 and 8)."""
    work = tmp_path_factory.mktemp("ema_straight")
    ckpt_train(work, assets, *ARGS, "--step_scheduler.max_steps", "8", "--checkpoint.checkpoint_dir", "run", nproc=2)
    return work / "run"


def test_killed_and_rerun_is_bitwise(tmp_path, assets, straight):
    cmd = [CKPT_TRAIN, "--nproc-per-node", "2", str(RECIPE), *QUIET, *ARGS, "--step_scheduler.max_steps", "8",
           "--checkpoint.checkpoint_dir", "run", "--recipe", step_faults.RECIPE]
    pid_file = tmp_path / "stopped.pid"  # rank 0 holds the job after step 5: the step-4 checkpoint is published
    with open(tmp_path / "killed.log", "w") as log:
        job = start_command(cmd, cwd=tmp_path, env=env_for(assets, step_faults.env(5, pid_file)), stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        held = step_faults.stopped(pid_file, job)
    finally:
        kill_job(job)
    first = (tmp_path / "killed.log").read_text()
    assert held is not None, f"the first launch ended before step 5: {first[-3000:]}"
    assert (tmp_path / "run" / layout.LATEST).exists() and not (tmp_path / "run" / "epoch_0_step_8").exists()
    rerun = ckpt_train(tmp_path, assets, *ARGS, "--step_scheduler.max_steps", "8", "--checkpoint.checkpoint_dir",
                       "run", nproc=2)
    assert "Loading checkpoint from" in rerun.output, rerun.output[-3000:]
    assert losses(tmp_path / "run") == losses(straight)
    got = _ema(tmp_path / "run" / "epoch_0_step_8", tmp_path / "got")
    want = _ema(straight / "epoch_0_step_8", tmp_path / "want")
    assert got.keys() == want.keys() and len(got) > 0
    assert all(torch.equal(got[k], want[k]) for k in want)
    weights = _model(straight / "epoch_0_step_8", tmp_path / "weights")
    assert got.keys() == weights.keys()  # every weight trains: the average is the whole model
    assert all(not torch.equal(got[k], weights[k]) for k in weights if weights[k].dim() > 1)  # an average


@pytest.mark.parametrize("dp_shard", ["auto", "full"])  # replicated (the tiny model fits), FSDP2's DTensors
def test_resumed_on_one_process_from_two_is_bitwise(tmp_path, assets, straight, dp_shard):
    """The 2-process run's step-4 average, resumed on 1 process, takes step 5's update exactly: ema5 == lerp(ema4,
    weights5, 1 - decay), bitwise, tensor by tensor."""
    start, shard = straight / "epoch_0_step_4", ("--distributed.dp_shard", dp_shard)
    if dp_shard != "auto":
        first = ckpt_train(tmp_path, assets, *ARGS, *shard, "--step_scheduler.max_steps", "4",
                           "--checkpoint.checkpoint_dir", "sharded", nproc=2)
        assert "sharded with FSDP2" in first.output
        start = tmp_path / "sharded" / "epoch_0_step_4"
    second = ckpt_train(tmp_path, assets, *ARGS, *shard, "--step_scheduler.max_steps", "5",
                        "--checkpoint.checkpoint_dir", "run", "--checkpoint.restore_from", str(start), nproc=1)
    assert "Resuming at world size 1 (checkpoint written by 2)" in second.stdout
    ema4 = _ema(start, tmp_path / "ema4")
    step5 = tmp_path / "run" / "epoch_0_step_5"
    ema5, weights5 = _ema(step5, tmp_path / "ema5"), _model(step5, tmp_path / "weights5")
    assert ema5.keys() == ema4.keys()
    for name, average in ema4.items():
        assert torch.equal(ema5[name], torch.lerp(average, weights5[name], 1 - float(DECAY))), name


def test_consolidate_ema_writes_a_hugging_face_folder_that_loads(tmp_path, straight, assets):
    import shutil

    from transformers import AutoModelForCausalLM

    ckpt = tmp_path / "ck"
    shutil.copytree(straight / "epoch_0_step_8", ckpt)
    done = run_command([CKPT_TRAIN, "consolidate", str(ckpt), "--ema", "--no-progress"], env=env_for(assets),
                       timeout=300)
    assert done.returncode == 0, done.stderr
    folder = CheckpointFolder(ckpt).model.consolidated_ema.path
    model = AutoModelForCausalLM.from_pretrained(folder)
    ema = _ema(ckpt, tmp_path / "fp32")
    for name, param in model.named_parameters():
        assert torch.equal(param.detach().float(), ema[name].to(param.dtype).float()), name
    plain = run_command([CKPT_TRAIN, "consolidate", str(tmp_path / "nothing"), "--ema"], env=env_for(assets),
                        timeout=300)
    assert plain.returncode != 0 and "holds no EMA weights" in plain.stderr
    shutil.rmtree(CheckpointFolder(ckpt).model.hf_metadata.path)  # as a LoRA checkpoint's adapter folder
    adapter = run_command([CKPT_TRAIN, "consolidate", str(ckpt), "--ema", "--out", str(tmp_path / "out")],
                          env=env_for(assets), timeout=300)
    assert adapter.returncode != 0 and "has no .hf_metadata" in adapter.stderr
