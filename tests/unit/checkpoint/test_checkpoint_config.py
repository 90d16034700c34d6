"""`checkpoint:` validates and normalises itself once, on creation; every holder sees canonical values."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from automodel_ckpt.checkpoint import Checkpointer, CheckpointConfig, ConsolidationMode, ModelSaveFormat
from automodel_ckpt.config.loader import load_config
from automodel_ckpt.config.schema import RecipeConfig
from automodel_ckpt.config.validate import validate_config
from automodel_ckpt.distributed.env import DistEnv
from automodel_ckpt.errors import ConfigError
from automodel_ckpt.recipes.llm_finetune import FinetuneRecipe

REPO = Path(__file__).resolve().parents[3]
RECIPE = str(REPO / "recipes" / "tiny_llama_sft.yaml")
ENV = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")


def test_choices_become_enums_and_aliases_resolve():
    cfg = CheckpointConfig(save_consolidated="True", model_save_format="torch_save", preemption_signal="usr1")
    assert cfg.save_consolidated is ConsolidationMode.EVERY and cfg.save_consolidated == "every"
    assert cfg.model_save_format is ModelSaveFormat.TORCH_SAVE and f"{cfg.model_save_format}" == "torch_save"
    assert cfg.preemption_signal == "SIGUSR1"
    with pytest.raises(ConfigError, match="checkpoint.model_save_format: expected one of safetensors, torch_save"):
        CheckpointConfig(model_save_format="pickle")


def test_an_empty_restore_from_means_not_set(tmp_path, monkeypatch):
    """`--checkpoint.restore_from ""` used to resolve to the current folder, then fail with "missing 'model'"."""
    cfg = load_config(RECIPE, ["--checkpoint.restore_from", "", "--checkpoint.checkpoint_dir", str(tmp_path / "run")],
                      RecipeConfig)
    validate_config(cfg, 1)
    recipe = FinetuneRecipe(cfg)  # the contract: the constructor takes the config; no process group needed
    assert recipe.checkpoint_config.restore_from is None
    (tmp_path / "model").mkdir()  # a current folder that looks like a checkpoint's parts must not be picked
    monkeypatch.chdir(tmp_path)
    checkpointer = Checkpointer(recipe.checkpoint_config, ENV, resolved_config_yaml="{}\n", say=lambda _: None)
    assert checkpointer._run.find(None) is None  # nothing saved yet: a fresh start


def test_the_recipe_config_keeps_what_the_user_wrote(tmp_path):
    """No copy-back into the OmegaConf node: the recipe reads the validated CheckpointConfig."""
    cfg = load_config(RECIPE, ["--checkpoint.save_consolidated", "true", "--checkpoint.preemption_signal", "usr2"],
                      RecipeConfig)
    validate_config(cfg, 1)
    assert cfg.checkpoint.save_consolidated == "true"
    ckpt = FinetuneRecipe(cfg).checkpoint_config
    assert ckpt.save_consolidated is ConsolidationMode.EVERY and ckpt.preemption_signal == "SIGUSR2"


def test_a_bad_value_is_a_one_line_config_error_at_validation():
    cfg = load_config(RECIPE, ["--checkpoint.save_consolidated", "sometimes"], RecipeConfig)
    with pytest.raises(ConfigError, match="checkpoint.save_consolidated: expected one of final, every"):
        validate_config(cfg, 1)


def test_more_local_ranks_than_gpus_is_one_line_naming_the_fix(monkeypatch):
    import pytest
    import torch

    from automodel_ckpt.distributed.env import init_distributed
    from automodel_ckpt.errors import UsageError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(UsageError, match=r"local rank 1 has no GPU: 1 visible .*CUDA_VISIBLE_DEVICES="):
        init_distributed()
