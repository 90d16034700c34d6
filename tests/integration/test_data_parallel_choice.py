"""The data-parallel strategy and the step's implementations: one process wraps nothing, two replicate the tiny model
(``distributed.dp_shard: auto``) or shard it (``full``); a checkpoint of either resumes under the other with the same
samples and losses (in its own run folder, and restored into another: ``checkpoint.restore_from``); a resume under
each, and with compiled blocks, repeats the straight run's steps bit for bit."""

from __future__ import annotations

import shutil

import pytest

from tests.integration.harness import ckpt_train, jsonl
from tests.integration.shared_runs import STRAIGHT_KEYS

FULL = ("--distributed.dp_shard", "full")


def _records(run_dir):
    return {r["step"]: r for r in jsonl(run_dir / "training.jsonl")}


def _leg(tmp_path, assets, name, steps, *keys, nproc=2, env=None):
    return ckpt_train(tmp_path, assets, *STRAIGHT_KEYS, "--checkpoint.checkpoint_dir", name,
                      "--step_scheduler.max_steps", str(steps), *keys, nproc=nproc, env=env)


def _layout(checkpoint):
    """Each model and optimizer file's name and size, and the tensors each safetensors shard holds."""
    from safetensors import safe_open

    files = {f"{f.parent.name}/{f.name}": f.stat().st_size for folder in ("model", "optim")
             for f in (checkpoint / folder).iterdir() if f.suffix in (".safetensors", ".distcp")}
    tensors = {}
    for shard in sorted((checkpoint / "model").glob("shard-*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            tensors[shard.name] = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert len(tensors) == 2 and any(name.startswith("optim/") for name in files)  # two ranks' files of each
    return files, tensors


def _restored(source):
    """The keys of a run restored from ``source``'s step-4 checkpoint: it logs steps 5 to 8 in a folder of its own."""
    return "--checkpoint.restore_from", str(source / "epoch_0_step_4")


def _same_samples_close_losses(run, straight):
    got, want = _records(run), _records(straight)
    assert sorted(got) in (list(range(1, 9)), list(range(5, 9)))  # the whole run, or restored at step 4
    for step in range(5, 9):
        assert got[step]["sample_ids"] == want[step]["sample_ids"]
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], abs=1e-5), step


def _bitwise(run, straight, steps):
    got, want = _records(run), _records(straight)
    for step in steps:
        assert (got[step]["loss"], got[step]["grad_norm"]) == (want[step]["loss"], want[step]["grad_norm"]), step


def test_replicated_and_sharded_checkpoints_resume_under_each_other(tmp_path, assets, straight_runs):
    replicated = straight_runs.get(2)  # the straight run: dp_shard auto, replicated
    first = _leg(tmp_path, assets, "sharded", 4, *FULL)
    assert "Data parallelism: sharded with FSDP2 (distributed.dp_shard: full)" in first.stdout
    assert "Optimizer: AdamW, fused implementation" in first.stdout
    shutil.copytree(tmp_path / "sharded", tmp_path / "to_replicated")
    # the same files whatever the strategy: each rank writes its slice of every parameter and moment
    assert _layout(replicated / "epoch_0_step_4") == _layout(tmp_path / "sharded" / "epoch_0_step_4")
    # sharded -> sharded: the straight sharded run's steps, bit for bit
    _leg(tmp_path, assets, "sharded", 8, *FULL)
    _leg(tmp_path, assets, "sharded_straight", 8, *FULL)
    _bitwise(tmp_path / "sharded", tmp_path / "sharded_straight", range(5, 9))
    # sharded -> replicated, and replicated -> sharded: the straight replicated run's samples and losses
    again = _leg(tmp_path, assets, "to_replicated", 8)
    assert "Data parallelism: replicated (auto: " in again.stdout
    _same_samples_close_losses(tmp_path / "to_replicated", replicated)
    restored = _leg(tmp_path, assets, "to_sharded", 8, *FULL, *_restored(replicated))
    assert f"Loading checkpoint from {replicated / 'epoch_0_step_4'}" in restored.stdout
    _same_samples_close_losses(tmp_path / "to_sharded", replicated)
    _same_samples_close_losses(tmp_path / "sharded_straight", replicated)  # the two strategies train alike


def test_one_process_wraps_nothing_and_resumes_compiled_blocks_bit_for_bit(tmp_path, assets, straight_runs):
    compiled = ("--training.compile", "true")
    one_thread = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}
    first = _leg(tmp_path, assets, "compiled_straight", 8, *compiled, nproc=1, env=one_thread)
    assert "Data parallelism: unwrapped (one data-parallel rank: nothing to exchange)" in first.stdout
    assert "torch.compile: on (training.compile: true)" in first.stdout
    _leg(tmp_path, assets, "compiled", 8, *compiled, *_restored(tmp_path / "compiled_straight"), nproc=1,
         env=one_thread)
    assert sorted(_records(tmp_path / "compiled")) == [5, 6, 7, 8]
    _bitwise(tmp_path / "compiled", tmp_path / "compiled_straight", range(5, 9))
    _same_samples_close_losses(tmp_path / "compiled", straight_runs.get(1))  # compiled blocks train alike
