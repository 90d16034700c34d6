"""Pipeline parallelism: dp 2 → pp 2 × dp 2 (1f1b) → pp 2 (gpipe) → 1 process with the straight dp 2 run's samples,
losses and gradient norms; pp 2 × tp 2; gpipe in DCP files; bitwise resume on an unchanged pipeline mesh in both
formats; and the lr 0 export of a pp 2 × dp 2 run equal to the base files. A Qwen2 with tied embeddings on pp 2:
its lr 0 export equal to the base files, and its losses, gradient norms and checkpoint keys those of dp 2."""

from __future__ import annotations

import json

import pytest
import torch

from tests.family_bases import build_family_base, folder_weights
from tests.integration.harness import ckpt_train, jsonl
from tests.integration.shared_runs import STRAIGHT_KEYS

EVERY_STEP = ("--step_scheduler.ckpt_every_steps", "1")
PP2_DP2 = ("--distributed.pp_size", "2")
GPIPE = ("--distributed.pp_schedule", "gpipe", "--distributed.pp_microbatches", "4")


def _records(run_dir) -> dict[int, dict]:
    return {r["step"]: r for r in jsonl(run_dir / "training.jsonl")}


def _leg(tmp_path, assets, run: str, step: int, nproc: int, *keys: str):
    return ckpt_train(tmp_path, assets, *STRAIGHT_KEYS, *EVERY_STEP, *keys, "--checkpoint.checkpoint_dir", run,
                      "--step_scheduler.max_steps", str(step), nproc=nproc)


def _assert_same_steps(run_dir, straight, steps) -> None:
    got, want = _records(run_dir), _records(straight)
    assert sorted(got) == list(steps)
    for step in steps:
        assert got[step]["sample_ids"] == want[step]["sample_ids"], step  # the same samples, in the same order
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], abs=1e-5), step
        assert got[step]["grad_norm"] == pytest.approx(want[step]["grad_norm"], rel=1e-5), step


def _assert_bitwise(run_dir, other, step: int) -> None:
    a, b = _records(run_dir)[step], _records(other)[step]
    assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"])


def test_pipeline_resumes_across_strategies_with_the_straight_runs_losses(tmp_path, assets, straight_runs):
    """From the straight dp 2 run's step-4 checkpoint: pp 2 × dp 2 (1f1b) to step 6, pp 2 on 2 processes (gpipe) to
    step 8, one process from step 7; pp 2 × tp 2 and pp 2 × dp 2 (gpipe, DCP files) to step 6. Each step as the straight run's; a
    resume from step 5 on the same mesh gives step 6 bit for bit, in both formats."""
    straight = straight_runs.get(2)
    start = ("--checkpoint.restore_from", str(straight / "epoch_0_step_4"))
    chain = tmp_path / "chain"
    out = _leg(tmp_path, assets, "chain", 6, 4, *PP2_DP2, *start)
    assert "Resuming a dp 2 checkpoint on dp 2 × pp 2 (world size 2 -> 4)" in out.stdout
    assert "Pipeline stage 1: decoder layers 2-3 (1f1b, 2 microbatches)" in out.stdout
    meta = json.loads((chain / "epoch_0_step_6" / "metadata.json").read_text())
    assert meta["mesh"] == {"dp_replicate": 1, "dp_shard": 2, "tp": 1, "pp": 2}
    # per-rank state per data-parallel rank, written once whatever the stages
    assert sorted(p.name for p in (chain / "epoch_0_step_6" / "rng").iterdir()) == ["rng_dp_rank_0.pt",
                                                                                   "rng_dp_rank_1.pt"]
    out = _leg(tmp_path, assets, "chain", 8, 2, *PP2_DP2, *GPIPE)
    assert "Resuming a dp 2 × pp 2 checkpoint on pp 2 (world size 4 -> 2)" in out.stdout
    _assert_same_steps(chain, straight, range(5, 9))
    # validation through the pipeline: the straight run's at its step-8 save
    assert jsonl(chain / "validation.jsonl")[-1]["val_loss"] == pytest.approx(
        jsonl(straight / "validation.jsonl")[-1]["val_loss"], abs=1e-5)
    out = _leg(tmp_path, assets, "back", 8, 1, "--checkpoint.restore_from", str(chain / "epoch_0_step_7"))
    assert "Resuming a pp 2 checkpoint on dp 1 (world size 2 -> 1)" in out.stdout
    _assert_same_steps(tmp_path / "back", straight, [8])

    # pp 2 × tp 2: the stages' projections split by the family's plan
    out = _leg(tmp_path, assets, "pptp", 6, 4, *PP2_DP2, "--distributed.tp_size", "2", *start)
    assert "Resuming a dp 2 checkpoint on pp 2 × tp 2 (world size 2 -> 4)" in out.stdout
    _assert_same_steps(tmp_path / "pptp", straight, range(5, 7))

    dcp = ("--checkpoint.model_save_format", "torch_save")
    _leg(tmp_path, assets, "dcp", 6, 4, *PP2_DP2, *GPIPE, *dcp, *start)
    assert (tmp_path / "dcp" / "epoch_0_step_6" / "model" / ".metadata").is_file()
    _assert_same_steps(tmp_path / "dcp", straight, range(5, 7))
    # the same pipeline mesh from its own step-5 checkpoint: step 6 bit for bit, in either format
    _leg(tmp_path, assets, "dcp_again", 6, 4, *PP2_DP2, *GPIPE, *dcp,
         "--checkpoint.restore_from", str(tmp_path / "dcp" / "epoch_0_step_5"))
    _assert_bitwise(tmp_path / "dcp_again", tmp_path / "dcp", 6)
    _leg(tmp_path, assets, "chain_again", 6, 4, *PP2_DP2, "--checkpoint.restore_from", str(chain / "epoch_0_step_5"))
    _assert_bitwise(tmp_path / "chain_again", chain, 6)


def _checkpoint_keys(checkpoint) -> tuple[list[set[str]], set[str]]:
    """Each model shard file's tensor names, and the optimizer's saved keys."""
    from safetensors import safe_open
    from torch.distributed.checkpoint import FileSystemReader

    files = []
    for shard in sorted((checkpoint / "model").glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            files.append(set(f.keys()))
    return files, set(FileSystemReader(str(checkpoint / "optim")).read_metadata().state_dict_metadata)


def test_tied_embeddings_under_stages_export_the_base_and_train_as_dp(tmp_path, assets):
    """Qwen2 with tied embeddings (the first stage's embedding and the last stage's head are one weight): the lr 0
    export of a pp 2 run is the base's files bit for bit; with a nonzero lr, pp 2 gives dp 2's losses and gradient
    norms (the tied gradient summed over the two stages, counted once), the two copies stay equal, and the
    checkpoint holds the keys a dp 2 checkpoint holds, the shared one written once."""
    base = build_family_base("qwen2", tmp_path / "qwen2_base")
    args = ("--model.pretrained_model_name_or_path", str(base), "--model.embedded", "null",
            "--dataset.num_samples", "400", "--data.val_size", "16", "--step_scheduler.global_batch_size", "16",
            "--step_scheduler.local_batch_size", "8", "--checkpoint.save_consolidated", "final")
    ckpt_train(tmp_path, assets, *args, *PP2_DP2, "--optimizer.lr", "0", "--step_scheduler.max_steps", "1",
               "--checkpoint.checkpoint_dir", "lr0", nproc=2)
    expected = folder_weights(base)
    actual = folder_weights(tmp_path / "lr0" / "epoch_0_step_1" / "model" / "consolidated")
    assert sorted(actual) == sorted(expected)
    for name, (file, tensor) in expected.items():
        assert actual[name][0] == file and torch.equal(actual[name][1].view(torch.uint8), tensor.view(torch.uint8))

    trained = (*args, "--lr_scheduler.warmup_steps", "0", "--step_scheduler.max_steps", "2")
    for run, keys in (("pp", PP2_DP2), ("dp", ())):
        ckpt_train(tmp_path, assets, *trained, *keys, "--checkpoint.checkpoint_dir", run, nproc=2)
    pp, dp = _records(tmp_path / "pp"), _records(tmp_path / "dp")
    assert sorted(pp) == sorted(dp) == [1, 2]
    for step in (1, 2):
        assert pp[step]["loss"] == pytest.approx(dp[step]["loss"], abs=1e-5), step
        assert pp[step]["grad_norm"] == pytest.approx(dp[step]["grad_norm"], rel=1e-5), step
    pp_files, pp_optim = _checkpoint_keys(tmp_path / "pp" / "epoch_0_step_2")
    dp_files, dp_optim = _checkpoint_keys(tmp_path / "dp" / "epoch_0_step_2")
    assert set().union(*pp_files) == set().union(*dp_files) and pp_optim == dp_optim
    assert sum("model.embed_tokens.weight" in keys for keys in pp_files) == 1  # both stages hold it: written once
    final = folder_weights(tmp_path / "pp" / "epoch_0_step_2" / "model" / "consolidated")
    assert "lm_head.weight" not in final  # tied: exported once, as save_pretrained writes it
    from safetensors.torch import load_file

    shards = {}
    for shard in (tmp_path / "pp" / "epoch_0_step_2" / "model").glob("*.safetensors"):
        shards.update(load_file(str(shard)))
    assert torch.equal(shards["lm_head.weight"], shards["model.embed_tokens.weight"])  # the copies stayed equal


def test_lr0_export_from_pp2_dp2_is_the_base(tmp_path, assets):
    """Each stage saves its own parameters under their whole-model names; the inline export writes the whole model
    in the base's layout, bit for bit."""
    ckpt_train(tmp_path, assets, *PP2_DP2, "--optimizer.lr", "0", "--dataset.num_samples", "400",
               "--data.val_size", "16", "--step_scheduler.global_batch_size", "16",
               "--step_scheduler.local_batch_size", "8", "--step_scheduler.max_steps", "1",
               "--checkpoint.save_consolidated", "final", "--checkpoint.checkpoint_dir", "run", nproc=4)
    expected = folder_weights(assets / "tiny_llama_base")
    actual = folder_weights(tmp_path / "run" / "epoch_0_step_1" / "model" / "consolidated")
    assert sorted(actual) == sorted(expected)
    for name, (file, tensor) in expected.items():
        assert actual[name][0] == file and actual[name][1].dtype == tensor.dtype, name
        assert torch.equal(actual[name][1].view(torch.uint8), tensor.view(torch.uint8)), name
