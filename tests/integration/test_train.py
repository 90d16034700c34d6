"""Training end to end: overrides take effect, the default recipe learns (two nodes: test_world_size_change.py)."""

from __future__ import annotations

import os
import sys

import pytest
import yaml

from tests.integration.harness import RECIPE, REPO, ckpt_train, jsonl

FAST = ("--checkpoint.save_consolidated", "false")
LEARNING_STEPS = 450  # of the default recipe's 900, at LEARNING_LR
#: the default recipe's learning rate of 3e-3 learns the task in 600 steps here; 2e-3 in 450 (its cosine over 450)
LEARNING_LR = ("--optimizer.lr", "2e-3")
#: validation every 150 steps instead of the recipe's 100: the same training (validation draws nothing from it)
LEARNING_VAL_EVERY = ("--step_scheduler.val_every_steps", "150")


def test_overrides_take_effect(tmp_path, assets):
    ckpt_train(tmp_path, assets, *FAST, "--step_scheduler.max_steps", "6", "--optimizer.lr=3e-4",
               "--checkpoint.checkpoint_dir", "run")
    records = jsonl(tmp_path / "run" / "training.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert set(records[0]) >= {"step", "epoch", "loss", "lr", "grad_norm", "tokens_per_sec", "step_seconds"}
    warmup = yaml.safe_load(RECIPE.read_text())["lr_scheduler"]["warmup_steps"]
    assert records[0]["lr"] == pytest.approx(3e-4 / warmup)
    saved = yaml.safe_load((tmp_path / "run" / "epoch_0_step_6" / "config.yaml").read_text())
    assert saved["optimizer"]["lr"] == 3e-4 and saved["step_scheduler"]["max_steps"] == 6


@pytest.mark.skipif(os.environ.get("SKIP_LEARNING_TEST") == "1", reason="SKIP_LEARNING_TEST=1")
def test_default_recipe_learns_and_generates(tmp_path, assets, capsys):
    """The embedded default as a user runs it: 2 processes, then generation from the consolidated export. Half its
    steps at a learning rate of 2e-3 learn the task: at 450 steps 0.94 of the answers exact with torch's AVX-512
    kernels, 0.91 with its AVX2 ones, 0.93 with its unvectorised ones (ATEN_CPU_CAPABILITY=default); 400 steps gave
    0.86 and 0.83. When the model finds carrying depends on rounding: at the recipe's 3e-3, 600 steps gave 0.93 on
    AVX-512 and 0.99 on AVX2, 450 steps 0.41 and 0.94."""
    result = ckpt_train(tmp_path, assets, "--step_scheduler.max_steps", str(LEARNING_STEPS), *LEARNING_LR,
                        *LEARNING_VAL_EVERY, nproc=2, timeout=1200)
    run = tmp_path / "checkpoints"
    val = [r["val_loss"] for r in jsonl(run / "validation.jsonl")]
    assert val[-1] < 0.5 * val[0], val
    assert "Saving checkpoint to" in result.stdout
    final = os.readlink(run / "LATEST")
    consolidated = run / final / "model" / "consolidated"
    assert (consolidated / "config.json").exists()
    # examples/generate.py through its main(argv), in this process: what its command line runs, without a new
    # interpreter importing torch and transformers again
    if str(REPO / "examples") not in sys.path:
        sys.path.insert(0, str(REPO / "examples"))  # the script's own folder, as when it runs (examples/evaluation.py)
    import generate

    code = generate.main([str(consolidated), "--n", "100"])
    out = capsys.readouterr().out
    assert code == 0, out[-3000:]
    accuracy = float(out.split("accuracy:")[1].split()[0])
    assert accuracy >= 0.8, out


def test_a_step_whose_loss_or_gradient_is_not_finite_stops_the_run_before_it_saves(tmp_path, assets):
    """A learning rate of 1e38 takes the weights past float32 after the first step: the next step's loss or
    gradient norm is NaN or infinite. The run stops there in one line, exit non-zero, and the last checkpoint is the
    step before it (none of the weights it reached is saved)."""
    result = ckpt_train(tmp_path, assets, *FAST, "--step_scheduler.max_steps", "4", "--step_scheduler.ckpt_every_steps",
                        "1", "--optimizer.lr", "1e38", "--lr_scheduler.warmup_steps", "0", "--data.val_size", "0",
                        "--checkpoint.checkpoint_dir", "run", check=False)
    errors = [line for line in result.output.splitlines() if "error:" in line]
    assert result.returncode != 0 and len(errors) == 1 and "Traceback" not in result.output, result.output[-3000:]
    stopped = int(errors[0].split("error: step ", 1)[1].split(":")[0])
    assert "is nan, not a finite number" in errors[0] or "inf, not a finite number" in errors[0], errors[0]
    saved = sorted(int(p.name.rsplit("_", 1)[1]) for p in (tmp_path / "run").glob("epoch_*_step_*"))
    assert saved == list(range(1, stopped)), (saved, errors[0])
    assert [r["step"] for r in jsonl(tmp_path / "run" / "training.jsonl")] == list(range(1, stopped))
