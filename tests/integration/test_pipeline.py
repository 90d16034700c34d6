"""Pipeline parallelism's exports and tied embeddings: the lr 0 export of a pp 2 × dp 2 run equal to the base files; a
Qwen2 with tied embeddings on pp 2: its lr 0 export equal to the base files, and its losses, gradient norms and
checkpoint keys those of dp 2. Resume across strategies through pipeline stages is in test_parallelism.py."""

from __future__ import annotations

import pytest
import torch

from tests.family_bases import build_family_base, folder_weights
from tests.integration.harness import ckpt_train, jsonl

PP2_DP2 = ("--distributed.pp_size", "2")


def _records(run_dir) -> dict[int, dict]:
    return {r["step"]: r for r in jsonl(run_dir / "training.jsonl")}


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
