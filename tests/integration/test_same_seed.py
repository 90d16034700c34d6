"""Same seed, same run: the first run in a fresh clone (which creates the embedded base on rank 0) logs the same
losses as every later run of the same command, for full fine-tuning and LoRA."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.harness import REPO, ckpt_train, losses

RECIPES = {"sft": REPO / "recipes" / "tiny_llama_sft.yaml", "lora": REPO / "recipes" / "tiny_llama_peft.yaml"}


@pytest.mark.parametrize("kind", sorted(RECIPES))
def test_first_run_in_fresh_clone_equals_later_runs(tmp_path: Path, kind: str) -> None:
    fresh_assets = tmp_path / "assets"  # no embedded base yet: the first run creates it
    args = ("--step_scheduler.max_steps", "4", "--step_scheduler.val_every_steps", "2", "--data.val_size", "64",
            "--checkpoint.enabled", "false")
    ckpt_train(tmp_path, fresh_assets, *args, "--checkpoint.checkpoint_dir", "first", nproc=2, recipe=RECIPES[kind])
    assert (fresh_assets / "tiny_llama_base" / "config.json").exists()
    ckpt_train(tmp_path, fresh_assets, *args, "--checkpoint.checkpoint_dir", "second", nproc=2, recipe=RECIPES[kind])
    first, second = losses(tmp_path / "first"), losses(tmp_path / "second")
    assert len(first) == 4
    assert first == second
