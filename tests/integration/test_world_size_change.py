"""Resume at another world size (2 → 1, 1 → 2 processes, 2 loopback nodes → 1): model, optimizer, data, RNG reshard."""

from __future__ import annotations

import subprocess

import pytest

from tests.integration.harness import CKPT_TRAIN, QUIET, RECIPE, ckpt_train, env_for, free_port, jsonl, start_command
from tests.integration.shared_runs import STRAIGHT_KEYS

ARGS = STRAIGHT_KEYS  # those of the straight runs (8 steps) that the resumed runs are compared with


def _records(run_dir):
    return {r["step"]: r for r in jsonl(run_dir / "training.jsonl")}


def _assert_matches(resumed, straight):
    got, want = _records(resumed), _records(straight)
    assert sorted(got) == list(range(1, 9))
    for step in range(5, 9):
        assert got[step]["sample_ids"] == want[step]["sample_ids"]  # exactly the same samples, none skipped
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], abs=1e-5)


@pytest.mark.parametrize("before,after", [(2, 1), (1, 2)])
def test_resume_with_another_process_count(tmp_path, assets, straight_runs, before, after):
    run = ("--checkpoint.checkpoint_dir", "resized")
    ckpt_train(tmp_path, assets, *ARGS, *run, "--step_scheduler.max_steps", "4", nproc=before)
    second = ckpt_train(tmp_path, assets, *ARGS, *run, "--step_scheduler.max_steps", "8", nproc=after)
    assert f"Resuming at world size {after} (checkpoint written by {before})" in second.stdout
    assert "global batch 64 kept" in second.stdout
    _assert_matches(tmp_path / "resized", straight_runs.get(after))
    ranks = sorted(p.name for p in (tmp_path / "resized" / "epoch_0_step_8" / "rng").iterdir())
    assert ranks == [f"rng_dp_rank_{r}.pt" for r in range(after)]


def test_two_nodes_resume_on_one_node(tmp_path, assets, straight_runs):
    port = str(free_port())
    run = ("--checkpoint.checkpoint_dir", "multi")
    procs = [
        start_command([CKPT_TRAIN, "--nnodes", "2", "--node-rank", str(r), "--nproc-per-node", "1",
                       "--master-addr", "127.0.0.1", "--master-port", port, str(RECIPE), *QUIET, *ARGS, *run,
                       "--step_scheduler.max_steps", "4"],
                      cwd=tmp_path, env=env_for(assets), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-2000:]
    # two nodes on loopback: one data-parallel rank each
    assert sorted(p.name for p in (tmp_path / "multi" / "epoch_0_step_4" / "rng").iterdir()) == \
           ["rng_dp_rank_0.pt", "rng_dp_rank_1.pt"]
    assert len(jsonl(tmp_path / "multi" / "training.jsonl")) == 4
    ckpt_train(tmp_path, assets, *ARGS, *run, "--step_scheduler.max_steps", "8", nproc=2)
    _assert_matches(tmp_path / "multi", straight_runs.get(2))


def test_global_batch_that_cannot_be_kept_is_a_clear_error(tmp_path, assets):
    bad = ckpt_train(tmp_path, assets, *ARGS, "--step_scheduler.local_batch_size", "48", nproc=2, check=False)
    assert bad.returncode != 0
    assert "global_batch_size (64) must be a multiple of local_batch_size × data-parallel size (48 × 2 = 96)" in bad.stderr
