"""Expert parallelism on 2 processes (Qwen3-MoE, Mixtral): dp 2 × ep 2 gives dp 2's loss and every gradient (with
LoRA too), and with tensor parallelism on 4 those of dp 2 × tp 2; a
straight ep 2 run's checkpoints resume bit for bit on ep 2 (both formats) and across ep 2 → dp 2 → dp 2 × pp 2 × ep 2
with its samples and losses; the lr 0 export of an ep 2 run is the base's files (Qwen3-MoE; Mixtral's goes the same way)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.family_bases import build_family_base, folder_weights
from tests.integration import forked_ranks
from tests.integration.harness import ckpt_train, env_for, jsonl, launch_failure

EP2 = ("--distributed.ep_size", "2")
KEYS = ("--model.embedded", "null", "--dataset.num_samples", "400", "--data.val_size", "16",
        "--step_scheduler.global_batch_size", "16", "--step_scheduler.local_batch_size", "4",
        "--training.log_sample_ids", "true", "--checkpoint.save_consolidated", "false",
        "--step_scheduler.ckpt_every_steps", "2")
TORCH_SAVE = ("--checkpoint.model_save_format", "torch_save")


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("moe_bases")
    build_family_base("qwen3_moe", root / "qwen3_moe")
    return root


def _run(tmp_path, assets, bases, run: str, step: int, *keys: str, nproc: int = 2):
    return ckpt_train(tmp_path, assets, "--model.pretrained_model_name_or_path", str(bases / "qwen3_moe"), *KEYS, *keys,
                      "--checkpoint.checkpoint_dir", run, "--step_scheduler.max_steps", str(step), nproc=nproc)


def _records(run_dir: Path, log: str = "training.jsonl") -> dict[int, dict]:
    return {r["step"]: r for r in jsonl(run_dir / log)}


def _assert_same_steps(run_dir: Path, straight: Path, steps, bitwise: bool = False) -> None:
    got, want = _records(run_dir), _records(straight)
    for step in steps:
        assert got[step]["sample_ids"] == want[step]["sample_ids"], step  # the same samples, in the same order
        if bitwise:
            assert (got[step]["loss"], got[step]["grad_norm"]) == (want[step]["loss"], want[step]["grad_norm"]), step
        else:
            assert got[step]["loss"] == pytest.approx(want[step]["loss"], abs=1e-5), step
            assert got[step]["grad_norm"] == pytest.approx(want[step]["grad_norm"], rel=1e-5), step
    got, want = _records(run_dir, "validation.jsonl"), _records(straight, "validation.jsonl")
    assert [got[step]["val_loss"] for step in steps if step in got] == pytest.approx(
        [want[step]["val_loss"] for step in steps if step in got], abs=1e-5)


def _gradients(assets, nproc: int, *families: str) -> str:
    done = forked_ranks.launch(nproc, Path(__file__).with_name("expert_parallel_gradients.py"), *families,
                               env=env_for(assets))
    assert done.returncode == 0, launch_failure(done)
    return done.stdout


def test_ep_gives_the_loss_and_every_gradient_of_dp(assets):
    """expert_parallel_gradients.py: dp 2 × ep 2 and dp 2 against the whole model, each rank on rows of its own; with
    LoRA on the attention, the adapters' gradients reach them through the experts' all-to-all."""
    out = _gradients(assets, 2, "qwen3_moe", "mixtral", "qwen3_moe+lora")
    for family in ("qwen3_moe", "mixtral", "qwen3_moe+lora"):
        assert f"{family}: dp 2 × ep 2 loss, grad norm and" in out


def test_ep_with_tensor_parallelism_gives_the_gradients_of_tp(assets):
    """On 4 processes, Qwen3-MoE: dp 2 × tp 2 × ep 2 (each token sent by one of the tensor-parallel peers that hold
    it) and dp 2 × tp 2 × ep 4 + SP against dp 2 × tp 2 and the whole model."""
    out = _gradients(assets, 4, "qwen3_moe")
    for mesh in ("dp 2 × tp 2 × ep 2", "dp 2 × tp 2 × ep 4 + SP"):
        assert f"qwen3_moe: {mesh} loss, grad norm and 25 gradients equal dp 2 × tp 2's" in out


def test_ep_checkpoints_resume_bitwise_on_ep_and_across_ep_and_dp(tmp_path, assets, bases):
    """A straight ep 2 run (DCP files) to step 8; from its step 2 on ep 2 (safetensors, saved in the background) to 4,
    bit for bit; from that step 4 on ep 2 again to 6, bit for bit; then dp 2 to 6 and, on 4 processes, pipeline
    stages with experts spread within each (dp 2 × pp 2 × ep 2) to 8, each step the straight run's."""
    straight = tmp_path / "straight"
    _run(tmp_path, assets, bases, "straight", 8, *EP2, *TORCH_SAVE)
    meta = json.loads((straight / "epoch_0_step_2" / "metadata.json").read_text())
    assert meta["mesh"] == {"dp_replicate": 1, "dp_shard": 2, "tp": 1, "ep": 2}
    assert sorted(p.name for p in (straight / "epoch_0_step_2" / "rng").iterdir()) == ["rng_dp_rank_0.pt",
                                                                                      "rng_dp_rank_1.pt"]
    chain = tmp_path / "chain"
    _run(tmp_path, assets, bases, "chain", 4, *EP2, "--checkpoint.restore_from", str(straight / "epoch_0_step_2"),
         "--checkpoint.is_async", "true")
    _assert_same_steps(chain, straight, (3, 4), bitwise=True)  # from DCP files
    _run(tmp_path, assets, bases, "again", 6, *EP2, "--checkpoint.restore_from", str(chain / "epoch_0_step_4"))
    _assert_same_steps(tmp_path / "again", straight, (5, 6), bitwise=True)  # from safetensors shards
    out = _run(tmp_path, assets, bases, "chain", 6)
    assert "Resuming a dp 2 × ep 2 checkpoint on dp 2: global batch 16 kept" in out.stdout
    _assert_same_steps(chain, straight, (5, 6))
    out = _run(tmp_path, assets, bases, "chain", 8, *EP2, "--distributed.pp_size", "2", nproc=4)
    assert "Resuming a dp 2 checkpoint on dp 2 × pp 2 × ep 2 (world size 2 -> 4): global batch 16 kept" in out.stdout
    meta = json.loads((chain / "epoch_0_step_8" / "metadata.json").read_text())
    assert meta["mesh"] == {"dp_replicate": 1, "dp_shard": 2, "tp": 1, "pp": 2, "ep": 2}
    _assert_same_steps(chain, straight, (7, 8))


def test_lr0_export_from_ep2_is_the_base(tmp_path, assets, bases):
    """The experts, held a half per rank, are exported whole in the base's own per-expert layout, bit for bit."""
    _run(tmp_path, assets, bases, "run", 1, *EP2, "--optimizer.lr", "0", "--checkpoint.save_consolidated", "final")
    expected = folder_weights(bases / "qwen3_moe")
    actual = folder_weights(tmp_path / "run" / "epoch_0_step_1" / "model" / "consolidated")
    assert sorted(actual) == sorted(expected)
    assert any(".experts.1." in name for name in expected)  # per-expert tensors, as the base stores them
    for name, (file, tensor) in expected.items():
        assert actual[name][0] == file and actual[name][1].dtype == tensor.dtype, name
        assert torch.equal(actual[name][1].view(torch.uint8), tensor.view(torch.uint8)), name
