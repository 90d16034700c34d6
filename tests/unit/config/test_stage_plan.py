"""A run's stages (``stages:``, docs/stages.md): the plan read from a recipe, each stage's recipe, and bad plans
refused in one line before training (``cli.common.check_recipe``, as the launcher and every worker check)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from automodel_ckpt.cli.common import check_recipe
from automodel_ckpt.config.loader import load_config, to_yaml
from automodel_ckpt.config.schema import RecipeConfig
from automodel_ckpt.config.stages import StagePlan, changed_keys
from automodel_ckpt.errors import ConfigError

BASE = {"step_scheduler": {"global_batch_size": 48, "local_batch_size": 8, "max_steps": 30},
        "checkpoint": {"checkpoint_dir": "run"}}


def _cfg(tmp_path: Path, stages: list, *overrides: str, **sections):
    recipe = {**BASE, **sections, "stages": stages}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    return load_config(tmp_path / "r.yaml", list(overrides), RecipeConfig)


def _refused(tmp_path: Path, stages: list, *overrides: str, world_size: int = 2, **sections) -> str:
    with pytest.raises(ConfigError) as err:
        check_recipe(_cfg(tmp_path, stages, *overrides, **sections), world_size, inputs=False)
    assert "\n" not in str(err.value)
    return str(err.value)


RAMP = [{"name": "mix", "at_step": 10, "set": {"step_scheduler.global_batch_size": 96,
                                              "dataset.num_samples": 500}},
        {"name": "anneal", "at_step": 20, "set": {
            "data.seq_length": 24, "lr_scheduler": {"_target_": "automodel_ckpt.training.lr.cooldown", "steps": 10,
                                                     "final_lr": 0.0}}}]


def test_each_stage_is_the_recipe_before_it_with_its_set_applied(tmp_path):
    cfg = _cfg(tmp_path, RAMP)
    check_recipe(cfg, 2, inputs=False)
    plan = StagePlan.of(cfg)
    assert [(s.name, s.at_step) for s in plan.stages] == [("main", 0), ("mix", 10), ("anneal", 20)]
    main, mix, anneal = (plan.config(i) for i in range(3))
    assert (main.step_scheduler.global_batch_size, mix.step_scheduler.global_batch_size,
            anneal.step_scheduler.global_batch_size) == (48, 96, 96)
    assert mix.dataset._target_ == main.dataset._target_ and mix.dataset.num_samples == 500  # merged, as overrides
    assert anneal.dataset.num_samples == 500 and anneal.data.seq_length == 24 and mix.data.seq_length == 32
    assert dict(anneal.lr_scheduler) == {"_target_": "automodel_ckpt.training.lr.cooldown", "steps": 10,
                                         "final_lr": 0.0}  # a new _target_: its section afresh
    # step s + 1 goes on in the stage whose at_step is the last <= s; step s was trained in the one before
    assert [plan.index_after(s) for s in (0, 9, 10, 19, 20, 29)] == [0, 0, 1, 1, 2, 2]
    assert [plan.index_of(s) for s in (0, 1, 10, 11, 20, 21)] == [0, 0, 0, 1, 1, 2]
    assert [plan.ends(i) for i in range(3)] == [10, 20, None]


def test_a_run_without_stages_has_no_plan_and_its_config_yaml_is_as_before(tmp_path):
    cfg = _cfg(tmp_path, [])
    assert StagePlan.of(cfg) is None
    assert "\nstages:" not in to_yaml(cfg) and "\nstages:" in to_yaml(_cfg(tmp_path, RAMP))
    assert StagePlan.of(_cfg(tmp_path, [], "--checkpoint.new_stage", "long")) is not None  # a stage at a resume


@pytest.mark.parametrize("stages,said", [
    ([{"name": "a", "at_step": 0, "set": {"data.seq_length": 24}}], "stages[0] (a).at_step: expected a step after 0"),
    ([{"name": "a", "at_step": -3, "set": {"data.seq_length": 24}}], "stages[0] (a).at_step: expected a step after 0"),
    ([{"name": "a", "at_step": 10, "set": {"data.seq_length": 24}},
      {"name": "b", "at_step": 10, "set": {"data.seq_length": 28}}], "stages[1] (b).at_step: expected a step after 10"),
    ([{"name": "a", "at_step": 12, "set": {"data.seq_length": 24}},
      {"name": "b", "at_step": 5, "set": {"data.seq_length": 28}}], "listed in the order they begin"),
    ([{"name": "a", "at_step": 30, "set": {"data.seq_length": 24}}], "is not before step_scheduler.max_steps (30)"),
    ([{"name": "a", "at_step": 1.5, "set": {"data.seq_length": 24}}], "at_step: expected a step after 0"),
    ([{"name": "a", "at_step": True, "set": {"data.seq_length": 24}}], "at_step: expected a step after 0"),
    ([{"name": "a", "at_step": 5, "set": {"data.seq_length": 24}},
      {"name": "a", "at_step": 9, "set": {"data.seq_length": 28}}], "another stage is named 'a'"),
    ([{"name": "main", "at_step": 5, "set": {"data.seq_length": 24}}], "another stage is named 'main'"),
    ([{"name": "a b", "at_step": 5, "set": {"data.seq_length": 24}}], "stages[0].name: expected a name"),
    ([{"name": "a", "at_step": 5}], "stages[0] (a).set: expected a mapping"),
    ([{"name": "a", "at_step": 5, "set": {"data.seq_length": 24}, "when": 3}], "unknown key 'when'"),
])
def test_a_plan_that_cannot_run_is_refused_in_one_line(tmp_path, stages, said):
    assert said in _refused(tmp_path, stages)


@pytest.mark.parametrize("key,said", [
    ("data.seq_lenght", "stages[0] (s).set: unknown key 'data.seq_lenght' (did you mean 'data.seq_length'?)"),
    ("step_schedulr.global_batch_size", "unknown key 'step_schedulr' (did you mean 'step_scheduler'?)"),
    ("lr_scheduler.min_lr_ratoi", "stages[0] (s): unknown key 'lr_scheduler.min_lr_ratoi' for automodel_ckpt"
                                  ".training.lr.warmup_cosine (did you mean 'lr_scheduler.min_lr_ratio'?)"),
])
def test_a_key_that_is_not_a_recipe_key_is_refused_with_the_suggestion_overrides_give(tmp_path, key, said):
    assert said in _refused(tmp_path, [{"name": "s", "at_step": 5, "set": {key: 3}}])


@pytest.mark.parametrize("key,value", [
    ("model.config", {"num_hidden_layers": 3}), ("model.pretrained_model_name_or_path", "other"),
    ("tokenizer.pretrained_model_name_or_path", "other"), ("peft.rank", 4), ("seed", 7),
    ("distributed.tp_size", 2), ("checkpoint.checkpoint_dir", "elsewhere"), ("model.freeze", ["embed_tokens"]),
    ("dpo.beta", 0.2), ("recipe", "x.Y"), ("optimizer._target_", "torch.optim.SGD"),
    ("step_scheduler.max_steps", 40), ("data.shuffle", False), ("data.val_size", 10),
])
def test_a_stage_never_changes_what_the_run_is_a_run_of(tmp_path, key, value):
    said = _refused(tmp_path, [{"name": "s", "at_step": 5, "set": {key: value}}])
    assert said.startswith("stages[0] (s).set: ") and "not a key a stage may change" in said


def test_a_stage_whose_batch_the_world_size_cannot_divide_is_refused(tmp_path):
    stages = [{"name": "big", "at_step": 5, "set": {"step_scheduler.global_batch_size": 72}}]
    check_recipe(_cfg(tmp_path, stages), 3, inputs=False)  # 72 = 8 x 3 x 3
    said = _refused(tmp_path, stages, world_size=2)
    assert said.startswith("stages[0] (big): step_scheduler.global_batch_size (72) must be a multiple of "
                           "local_batch_size × data-parallel size (8 × 2 = 16)")
    said = _refused(tmp_path, [{"name": "small", "at_step": 5, "set": {"step_scheduler.local_batch_size": 5}}])
    assert said.startswith("stages[0] (small): step_scheduler.global_batch_size (48) must be a multiple")


def test_what_the_recipe_checks_is_checked_in_every_stage(tmp_path):
    assert "stages[0] (s): data.seq_length: expected at least 2" in \
        _refused(tmp_path, [{"name": "s", "at_step": 5, "set": {"data.seq_length": 1}}])
    assert "stages[0] (s): " in _refused(tmp_path, [{"name": "s", "at_step": 5, "set": {
        "lr_scheduler": {"_target_": "automodel_ckpt.training.lr.cooldown", "stepz": 3}}}])


@pytest.mark.parametrize("overrides,said", [
    (("--checkpoint.enabled", "false"), "stages: a stage begins at a checkpoint of the run"),
    (("--grpo.num_generations", "2"), "stages: an online RL run"),
])
def test_a_run_that_cannot_take_stages_is_refused(tmp_path, overrides, said):
    assert said in _refused(tmp_path, [{"name": "s", "at_step": 5, "set": {"data.seq_length": 24}}], *overrides)


@pytest.mark.parametrize("overrides,said", [
    (("--checkpoint.new_stage", "two words"), "checkpoint.new_stage: expected a stage name"),
    (("--checkpoint.new_stage", "x", "--checkpoint.restore_from", "/a/b", "--checkpoint.load_only", "[model]"),
     "a weights-only start (checkpoint.load_only) is a new run"),
])
def test_a_new_stage_named_at_a_resume_is_checked(tmp_path, overrides, said):
    assert said in _refused(tmp_path, [], *overrides)


def test_the_keys_a_rerun_changed_are_named_by_their_dotted_keys():
    before = {"step_scheduler": {"global_batch_size": 48, "max_steps": 10, "local_batch_size": 8},
              "data": {"seq_length": 16}, "dataset": {"_target_": "a.b", "num_samples": 5},
              "lr_scheduler": {"_target_": "x.warmup_cosine", "warmup_steps": 3}, "seed": 1, "model": {"a": 1}}
    after = {"step_scheduler": {"global_batch_size": 96, "max_steps": 20, "local_batch_size": 8},
             "data": {"seq_length": 16}, "dataset": {"_target_": "a.b", "num_samples": 9},
             "lr_scheduler": {"_target_": "x.cooldown", "steps": 3}, "seed": 2, "model": {"a": 2}}
    assert changed_keys(before, after) == ["dataset.num_samples", "lr_scheduler", "step_scheduler.global_batch_size"]
    assert changed_keys(["not", "a", "recipe"], after) == []
    assert changed_keys(before, before) == []



def test_a_stage_of_a_streamed_corpus_may_change_its_sources_and_length_but_not_its_order(tmp_path):
    stream = {"_target_": "automodel_ckpt.data.stream.generated.builtin_text_corpus", "num_files": 4}
    check_recipe(_cfg(tmp_path, [{"name": "s", "at_step": 5, "set": {"data.seq_length": 24, "dataset.num_files": 8}}],
                      dataset=stream), 2, inputs=False)
    for key in ("data.lanes", "data.shuffle_buffer"):
        said = _refused(tmp_path, [{"name": "s", "at_step": 5, "set": {key: 8}}], dataset=stream)
        assert said.startswith(f"stages[0] (s).set: '{key}' is not a key a stage may change")
