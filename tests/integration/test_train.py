"""Training end to end: overrides take effect, two nodes on loopback, the default recipe learns."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import yaml

from tests.integration.harness import CKPT_TRAIN, QUIET, RECIPE, REPO, ckpt_train, env_for, jsonl, losses

FAST = ("--checkpoint.save_consolidated", "false")


def test_overrides_take_effect(tmp_path, assets):
    ckpt_train(tmp_path, assets, *FAST, "--step_scheduler.max_steps", "6", "--optimizer.lr=3e-4",
               "--checkpoint.checkpoint_dir", "run")
    records = jsonl(tmp_path / "run" / "training.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert set(records[0]) >= {"step", "epoch", "loss", "lr", "grad_norm", "tokens_per_sec"}
    warmup = yaml.safe_load(RECIPE.read_text())["lr_scheduler"]["warmup_steps"]
    assert records[0]["lr"] == pytest.approx(3e-4 / warmup)
    saved = yaml.safe_load((tmp_path / "run" / "epoch_0_step_6" / "config.yaml").read_text())
    assert saved["optimizer"]["lr"] == 3e-4 and saved["step_scheduler"]["max_steps"] == 6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_on_loopback(tmp_path, assets):
    port = str(_free_port())
    procs = []
    for node_rank in (0, 1):
        cmd = [CKPT_TRAIN, "--nnodes", "2", "--node-rank", str(node_rank), "--nproc-per-node", "1",
               "--master-addr", "127.0.0.1", "--master-port", port, str(RECIPE), *QUIET, *FAST,
               "--step_scheduler.max_steps", "4", "--step_scheduler.ckpt_every_steps", "2",
               "--checkpoint.checkpoint_dir", "run"]
        procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=env_for(assets), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    ckpt = tmp_path / "run" / "epoch_0_step_4"
    assert sorted(p.name for p in (ckpt / "rng").iterdir()) == ["rng_dp_rank_0.pt", "rng_dp_rank_1.pt"]
    assert len(losses(tmp_path / "run")) == 4


@pytest.mark.skipif(os.environ.get("SKIP_LEARNING_TEST") == "1", reason="SKIP_LEARNING_TEST=1")
def test_default_recipe_learns_and_generates(tmp_path, assets):
    """The embedded default as a user runs it: 2 processes, then generation from the consolidated export."""
    result = ckpt_train(tmp_path, assets, nproc=2, timeout=1200)
    run = tmp_path / "checkpoints"
    val = [r["val_loss"] for r in jsonl(run / "validation.jsonl")]
    assert val[-1] < 0.5 * val[0], val
    assert "Saving checkpoint to" in result.stdout
    final = os.readlink(run / "LATEST")
    consolidated = run / final / "model" / "consolidated"
    assert (consolidated / "config.json").exists()
    gen = subprocess.run([sys.executable, str(REPO / "examples" / "generate.py"), str(consolidated), "--n", "100"],
                         capture_output=True, text=True, timeout=600, env=env_for(assets))
    assert gen.returncode == 0, gen.stderr[-3000:]
    accuracy = float(gen.stdout.split("accuracy:")[1].split()[0])
    assert accuracy >= 0.8, gen.stdout
