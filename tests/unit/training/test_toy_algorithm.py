"""A new algorithm is one class that reads its ``TrainContext``, its recipe section registered by one line and a
recipe class that names it: a toy one (a share of each token's loss, from its ``toy:`` section, the tokens it scored
as its metric, a counter as its state) is loaded and checked by the config and trains, logs and saves through the
fine-tune's loop unchanged."""

from __future__ import annotations

import json
import pickle
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from automodel_ckpt.algorithms.base import Algorithm, Numbers
from automodel_ckpt.algorithms.context import LossResult
from automodel_ckpt.algorithms.sft.algorithm import supervised_data
from automodel_ckpt.config.sections import AlgorithmSection, register_section, unregister_section
from automodel_ckpt.data import IGNORE_INDEX
from automodel_ckpt.errors import ConfigError
from automodel_ckpt.training.loss import next_token_loss_sum

REPO = Path(__file__).resolve().parents[3]


class Scored:
    """The toy's counter (checkpointed as ``scored``)."""

    tokens = 0

    def state_dict(self):
        return {"tokens": self.tokens}

    def load_state_dict(self, state):
        self.tokens = state["tokens"]


@dataclass
class ToyConfig:
    """The toy's ``toy:`` section."""

    share: float = 0.5  # the share of each token's loss that trains


def check_toy(cfg, sizes):
    if not 0 < cfg.toy.share <= 1:
        raise ConfigError(f"toy.share: expected a value in (0, 1], got {cfg.toy.share}")


@pytest.fixture
def toy_section():
    """The toy's section, registered by one line for the test's length."""
    register_section(AlgorithmSection("toy", ToyConfig, "a toy algorithm's keys", check=check_toy))
    yield
    unregister_section("toy")


class HalfLoss(Algorithm):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.scored = Scored()
        self.share = ctx.cfg.toy.share

    def build_loader(self):
        return supervised_data(self.ctx)

    def loss_count(self, mb):
        return (mb.labels[:, 1:] != IGNORE_INDEX).sum()

    def loss_target(self, mb):
        return mb.labels

    def compute_loss(self, logits, target):
        target = target.to(logits.device)
        tokens = (target[:, 1:] != IGNORE_INDEX).sum().double().reshape(1)
        return LossResult(self.share * next_token_loss_sum(logits, target, IGNORE_INDEX), tokens)

    def validate(self, batches):
        return Numbers(0.0, {})

    def step_done(self, loss, global_count, sums):
        scored = int(self.ctx.dims.sum_over_dp(torch.stack(sums).sum(dim=0).cpu()).item())
        self.scored.tokens += scored
        return Numbers(loss, {"scored_tokens": scored})


def _load(*overrides):
    from automodel_ckpt.config.loader import load_config
    from automodel_ckpt.config.schema import RecipeConfig

    return load_config(str(REPO / "recipes" / "tiny_llama_sft.yaml"), list(overrides), RecipeConfig)


def test_a_registered_section_is_loaded_and_checked_by_the_config(toy_section):
    from automodel_ckpt.config.validate import validate_config

    assert _load().get("toy") is None  # absent unless the recipe gives it
    cfg = _load("--toy.share", "0.25")
    assert cfg.toy.share == 0.25
    assert pickle.loads(pickle.dumps(cfg)).toy.share == 0.25  # a loaded recipe still pickles
    validate_config(cfg, 1)
    with pytest.raises(ConfigError, match=r"toy\.share: expected a value in \(0, 1\], got 2"):
        validate_config(_load("--toy.share", "2"), 1)
    with pytest.raises(ConfigError, match="toy.share: expected float"):
        _load("--toy.share", "most")
    with pytest.raises(ConfigError, match="unknown key 'toy.shares'"):
        _load("--toy.shares", "0.5")


def test_an_unregistered_section_is_an_unknown_key():
    with pytest.raises(ConfigError, match="unknown key 'toy'"):
        _load("--toy.share", "0.5")


def test_a_toy_algorithm_trains_logs_and_saves_through_the_fine_tune(tmp_path, monkeypatch, toy_section):
    from automodel_ckpt.config.validate import validate_config
    from automodel_ckpt.models.tiny import ensure_tiny_base
    from automodel_ckpt.recipes.llm_finetune import FinetuneRecipe

    ensure_tiny_base(tmp_path / "assets" / "tiny_llama_base")
    monkeypatch.setenv("AUTOMODEL_CKPT_ASSETS", str(tmp_path / "assets"))
    run_dir = tmp_path / "run"
    cfg = _load(
        "--training.progress_bar", "false", "--step_scheduler.max_steps", "2", "--step_scheduler.ckpt_every_steps",
        "2", "--checkpoint.save_consolidated", "false", "--checkpoint.checkpoint_dir", str(run_dir),
        "--data.val_size", "0", "--dataset.num_samples", "64", "--step_scheduler.global_batch_size", "8",
        "--step_scheduler.local_batch_size", "8", "--toy.share", "0.5",
    )
    validate_config(cfg, 1)

    class ToyRecipe(FinetuneRecipe):
        algorithm_class = HalfLoss

    recipe = ToyRecipe(cfg)
    recipe.run()
    records = [json.loads(line) for line in (run_dir / "training.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and all(r["scored_tokens"] > 0 for r in records)
    assert recipe.algorithm.scored.tokens == sum(r["scored_tokens"] for r in records)
    assert "scored" in recipe.checkpointed_state()  # the toy's state is saved beside the fine-tune's
    assert (run_dir / "epoch_0_step_2" / "config.yaml").read_text().count("share: 0.5") == 1  # its section kept
