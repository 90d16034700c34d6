"""Resume across parallelism strategies: dp 4 → dp 2 × tp 2 → tp 2 → HSDP 2 × 2 → 1 process, as a straight dp 4 run."""

from __future__ import annotations

import json

import pytest

from tests.integration.harness import ckpt_train, jsonl

BATCH = ("--step_scheduler.global_batch_size", "32", "--step_scheduler.local_batch_size", "8",
         "--data.val_size", "16", "--training.log_sample_ids", "true", "--checkpoint.save_consolidated", "false",
         "--step_scheduler.ckpt_every_steps", "2")
DP4 = ()
DP2_TP2 = ("--distributed.tp_size", "2")
TP2 = ("--distributed.tp_size", "2")
HSDP = ("--distributed.dp_replicate_size", "2")
LEGS = [  # (processes, mesh keys, what the resume line calls the mesh)
    (4, DP4, "dp 4"),
    (4, DP2_TP2, "dp 2 × tp 2"),
    (2, TP2, "tp 2"),
    (4, HSDP, "HSDP 2 × 2"),
    (1, DP4, "dp 1"),
]


def _records(run_dir):
    return {r["step"]: r for r in jsonl(run_dir / "training.jsonl")}


def _chain(tmp_path, assets, fmt: str, legs, steps_per_leg: int = 2):
    fmt_args = ("--checkpoint.model_save_format", fmt)
    total = steps_per_leg * len(legs)
    ckpt_train(tmp_path, assets, *BATCH, *fmt_args, "--step_scheduler.max_steps", str(total),
               "--checkpoint.checkpoint_dir", "straight", nproc=4)
    run = ("--checkpoint.checkpoint_dir", "chain")
    before = None
    for i, (nproc, keys, name) in enumerate(legs):
        out = ckpt_train(tmp_path, assets, *BATCH, *fmt_args, *run, *keys,
                         "--step_scheduler.max_steps", str(steps_per_leg * (i + 1)), nproc=nproc)
        if before is not None:
            assert f"Resuming a {before} checkpoint on {name}" in out.stdout
        meta = json.loads((tmp_path / "chain" / f"epoch_0_step_{steps_per_leg * (i + 1)}" / "metadata.json").read_text())
        assert meta["world_size"] == nproc
        before = name
    got, want = _records(tmp_path / "chain"), _records(tmp_path / "straight")
    assert sorted(got) == list(range(1, total + 1))
    for step in range(1, total + 1):
        assert got[step]["sample_ids"] == want[step]["sample_ids"], step  # the same samples, in the same order
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], abs=1e-5), step
    return tmp_path / "chain"


def test_resume_across_strategies_keeps_samples_and_losses(tmp_path, assets):
    chain = _chain(tmp_path, assets, "safetensors", LEGS)
    # per-rank state is per data-parallel rank: dp 2 × tp 2 wrote two RNG files, tp 2 one
    assert sorted(p.name for p in (chain / "epoch_0_step_4" / "rng").iterdir()) == ["rng_dp_rank_0.pt",
                                                                                   "rng_dp_rank_1.pt"]
    assert sorted(p.name for p in (chain / "epoch_0_step_6" / "rng").iterdir()) == ["rng_dp_rank_0.pt"]
    meta = json.loads((chain / "epoch_0_step_4" / "metadata.json").read_text())
    assert meta["mesh"] == {"dp_replicate": 1, "dp_shard": 2, "tp": 2}
