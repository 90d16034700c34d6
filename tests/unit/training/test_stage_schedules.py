"""What a stage changes at run time (docs/stages.md): its schedules (``cooldown``, ``wsd``), where the step scheduler
ends a stage, and the stages a checkpoint lists, read back field by field (untrusted)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from automodel_ckpt.errors import CheckpointError
from automodel_ckpt.training.lr import cooldown, one_cycle, wsd
from automodel_ckpt.training.stages import describe, read_history, record
from automodel_ckpt.training.step_scheduler import StepScheduler


def _lrs(make, steps: int, lr: float = 1.0) -> list[float]:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    schedule = make(optimizer)
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    return out


def test_cooldown_goes_in_a_line_from_the_lr_in_force_to_final_lr_over_its_steps():
    got = _lrs(lambda o: cooldown(o, total_steps=99, steps=4, final_lr=0.1), 6, lr=0.5)
    assert got == pytest.approx([0.5, 0.4, 0.3, 0.2, 0.1, 0.1])


def test_cooldown_keeps_its_steps_and_final_lr_from_the_recipe_not_from_a_checkpoint():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    schedule = cooldown(optimizer, total_steps=9, steps=4, final_lr=0.1)
    optimizer.step()
    schedule.step()
    state = schedule.state_dict()
    assert "steps" not in state and "final_lr" not in state
    other = cooldown(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5), total_steps=9, steps=8,
                     final_lr=0.0)
    other.load_state_dict(state | {"steps": 10**9, "final_lr": -5.0})  # a crafted file changes neither
    assert (other.steps, other.final_lr, other.last_epoch) == (8, 0.0, 1)


@pytest.mark.parametrize("steps,final_lr", [(0, 0.0), (-2, 0.0), (2.5, 0.0), (True, 0.0), (3, -1.0), (3, math.nan)])
def test_cooldown_refuses_what_is_no_cooldown(steps, final_lr):
    with pytest.raises(ValueError, match="cooldown"):
        cooldown(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5), 10, steps=steps, final_lr=final_lr)


def test_wsd_warms_up_holds_and_decays_over_its_last_steps():
    assert _lrs(lambda o: wsd(o, total_steps=8, warmup_steps=2, decay_steps=4), 9) == \
        pytest.approx([0.5, 1.0, 1.0, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0])
    assert _lrs(lambda o: wsd(o, total_steps=10, decay_fraction=0.2, min_lr_ratio=0.5, decay="cosine"), 11)[-3:] == \
        pytest.approx([1.0, 0.75, 0.5])
    assert _lrs(lambda o: wsd(o, total_steps=4, decay_steps=4, decay="sqrt"), 5) == \
        pytest.approx([1.0, 1 - math.sqrt(0.25), 1 - math.sqrt(0.5), 1 - math.sqrt(0.75), 0.0])
    assert _lrs(lambda o: wsd(o, total_steps=50, warmup_steps=1), 50) == [1.0] * 50  # no decay: a cooldown stage's


@pytest.mark.parametrize("kwargs", [{"decay": "step"}, {"decay_fraction": 1.5}, {"decay_steps": -1}])
def test_wsd_refuses_what_it_cannot_draw(kwargs):
    with pytest.raises(ValueError, match="wsd"):
        wsd(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5), 10, **kwargs)


@pytest.mark.parametrize("anneal", ["linear", "cos"])
def test_one_cycle_holds_its_last_value_past_its_end(anneal):
    """A run that goes on past the schedule's last step (a longer resume) trains at its final lr, never below it."""
    got = _lrs(lambda o: one_cycle(o, total_steps=4, ends=[2.0, 4.0], factors=[0.1, 1.0, 0.1], anneal=anneal), 12)
    assert got[:5] == pytest.approx([0.1, 0.55, 1.0, 0.55, 0.1])
    assert got[4:] == pytest.approx([0.1] * 8)


def test_a_stage_ends_after_its_step_with_a_checkpoint_there_and_not_at_the_run_end():
    sched = StepScheduler(max_steps=10, num_epochs=1, steps_per_epoch=100, ckpt_every_steps=7)
    sched.stop_at = 4
    seen = []
    while not sched.done:
        sched.record_step(0, 8)
        seen.append((sched.step, sched.is_ckpt_step, sched.stage_ends))
        if sched.stage_ends:
            break
    assert seen == [(1, False, False), (2, False, False), (3, False, False), (4, True, True)]
    sched.stop_at = 10  # the last stage's end is the run's: the final save, no stage ends there
    sched.step = 9
    sched.record_step(0, 8)
    assert sched.done and sched.is_ckpt_step and not sched.stage_ends


def test_the_run_end_by_epochs_follows_the_data_left_once_a_stage_sets_it():
    sched = StepScheduler(max_steps=None, num_epochs=2, steps_per_epoch=10)
    assert sched.total_steps == 20
    sched.epochs_end = 14  # after a batch change: the steps the data left makes
    assert sched.total_steps == 14
    sched.max_steps = 12
    assert sched.total_steps == 12


HISTORY = [record("main", 1, 0, 0, [], 0.001, {"from": 0, "steps": 30}),
           record("mix", 11, 480, 7680, ["step_scheduler.global_batch_size"], 0.001, {"from": 0, "steps": 30}),
           record("anneal", 21, 1440, 23040, ["data.seq_length", "lr_scheduler"], 0.001, {"from": 20, "steps": 10})]


def test_a_checkpoints_stages_read_back_as_written():
    assert read_history({"step": 25, "stages": HISTORY, "consumed_tokens": 30000}, "m") == (HISTORY, 30000)
    assert read_history({"step": 25}, "m") == ([], None)  # a run without stages
    lines = describe(HISTORY)
    assert lines[0] == "  main: from step 1 (after 0 samples, 0 tokens): the recipe as written"
    assert lines[2] == "  anneal: from step 21 (after 1440 samples, 23040 tokens): data.seq_length, lr_scheduler"


def _bad(index: int, key: str, value):
    stages = copy.deepcopy(HISTORY)
    stages[index][key] = value
    return stages


@pytest.mark.parametrize("meta,field", [
    ({"stages": "main"}, "'stages' is"),
    ({"stages": []}, "'stages' is"),
    ({"stages": [HISTORY[0]] * 1001}, "'stages' is"),
    ({"stages": HISTORY, "consumed_tokens": -1}, "'consumed_tokens' is -1"),
    ({"stages": HISTORY, "consumed_tokens": 1.5}, "'consumed_tokens' is 1.5"),
    ({"stages": [7]}, "'stages[0]' is 7"),
    ({"stages": _bad(1, "name", "../x")}, "'stages[1].name' is"),
    ({"stages": _bad(1, "name", "main")}, "'stages[1].name' is"),  # the stage before it again
    ({"stages": _bad(1, "name", 3)}, "'stages[1].name' is 3"),
    ({"stages": _bad(0, "first_step", 0)}, "'stages[0].first_step' is 0"),
    ({"stages": _bad(2, "first_step", 11)}, "'stages[2].first_step' is 11"),  # not after the stage before
    ({"stages": _bad(2, "first_step", 27)}, "'stages[2].first_step' is 27"),  # after the checkpoint's step
    ({"stages": _bad(2, "first_step", 10**30)}, "'stages[2].first_step' is"),
    ({"stages": _bad(1, "samples", -5)}, "'stages[1].samples' is -5"),
    ({"stages": _bad(2, "samples", 100)}, "'stages[2].samples' is 100"),  # fewer than before it
    ({"stages": _bad(1, "tokens", "many")}, "'stages[1].tokens' is"),
    ({"stages": _bad(1, "changed", "dataset")}, "'stages[1].changed' is"),
    ({"stages": _bad(1, "changed", ["rm -rf /"])}, "'stages[1].changed' is"),
    ({"stages": _bad(1, "changed", ["k"] * 65)}, "'stages[1].changed' is"),
    ({"stages": _bad(1, "lr", math.inf)}, "'stages[1].lr' is"),
    ({"stages": _bad(1, "lr", -0.1)}, "'stages[1].lr' is -0.1"),
    ({"stages": _bad(1, "lr", True)}, "'stages[1].lr' is"),
    ({"stages": _bad(2, "schedule", {"from": 25, "steps": 4})}, "'stages[2].schedule' is"),
    ({"stages": _bad(2, "schedule", {"from": 20, "steps": 0})}, "'stages[2].schedule' is"),
    ({"stages": _bad(2, "schedule", [20, 10])}, "'stages[2].schedule' is"),
])
def test_a_crafted_list_of_stages_is_one_line_naming_the_file_and_the_field(meta, field):
    with pytest.raises(CheckpointError) as err:
        read_history({"step": 25, **meta}, "'run/epoch_0_step_25/metadata.json'")
    said = str(err.value)
    assert said.startswith("'run/epoch_0_step_25/metadata.json': ") and field in said and "\n" not in said
    assert len(said) < 400


def _staged_recipe(tmp_path, stage_set: dict, step: int = 4):
    """A fine-tune's parts a stage's start works on, real ones (optimizer, schedule, step counters, map-style loader),
    restored at ``step`` with the plan's stage 1 (``stage_set``) beginning at the next step."""
    import types

    import datasets
    import yaml

    from automodel_ckpt.config.instantiate import instantiate
    from automodel_ckpt.config.loader import load_config
    from automodel_ckpt.config.schema import RecipeConfig
    from automodel_ckpt.config.stages import StagePlan
    from automodel_ckpt.data.loader import GlobalBatchLoader
    from automodel_ckpt.data.tokenize import TokenizedData
    from automodel_ckpt.recipes.stages import StageRun

    recipe = {"step_scheduler": {"global_batch_size": 4, "local_batch_size": 2, "max_steps": 12},
              "optimizer": {"_target_": "torch.optim.AdamW", "lr": 0.01, "weight_decay": 0.01},
              "lr_scheduler": {"_target_": "automodel_ckpt.training.lr.warmup_cosine", "warmup_steps": 2},
              "stages": [{"name": "s", "at_step": step, "set": stage_set}]}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    plan = StagePlan.of(load_config(tmp_path / "r.yaml", [], RecipeConfig))
    cfg = plan.config(1)
    rows = datasets.Dataset.from_dict({"input_ids": [[i, i] for i in range(40)], "labels": [[i, i] for i in range(40)],
                                       "attention_mask": [[1, 1]] * 40, "length": [2] * 40,
                                       "sample_id": list(range(40))})
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    schedule = instantiate(plan.config(0).lr_scheduler, "lr_scheduler", optimizer, total_steps=12)
    for _ in range(step):  # the steps before the stage, under the first stage's schedule
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()
        schedule.step()
    sched = StepScheduler(max_steps=12, num_epochs=1, steps_per_epoch=10)
    for _ in range(step):
        sched.record_step(0, 4)
    run = StageRun(cfg, plan, 1)
    run.built(model, {"recipe": {}}, lambda c: {})
    said: list[str] = []
    parts = types.SimpleNamespace(
        step_scheduler=sched, optimizer=optimizer, lr_scheduler=schedule,
        dataloader=GlobalBatchLoader(TokenizedData(rows), global_batch_size=4, local_batch_size=2, rank=0,
                                     world_size=1, seed=1),
        restored=types.SimpleNamespace(path=None, states=()), env=types.SimpleNamespace(is_main=True),
        progress=types.SimpleNamespace(write=said.append))
    return run, parts, optimizer, said


def test_a_stage_that_sets_a_schedule_starts_it_at_its_first_step_from_the_lr_in_force(tmp_path):
    run, recipe, optimizer, said = _staged_recipe(tmp_path, {"lr_scheduler": {
        "_target_": "automodel_ckpt.training.lr.cooldown", "steps": 4, "final_lr": 0.0},
        "optimizer.weight_decay": 0.1})
    in_force = optimizer.param_groups[0]["lr"]
    moments = {k: v.clone() for k, v in optimizer.state[next(iter(optimizer.state))].items()}
    run.restored(recipe)
    group = optimizer.param_groups[0]
    assert group["lr"] == in_force and group["weight_decay"] == 0.1  # the stage's hyper-parameter applied
    assert all(torch.equal(optimizer.state[next(iter(optimizer.state))][k], v) for k, v in moments.items())
    lrs = []
    for _ in range(5):
        lrs.append(group["lr"])
        optimizer.step()
        recipe.lr_scheduler.step()
    assert lrs == pytest.approx([in_force * f for f in (1.0, 0.75, 0.5, 0.25, 0.0)])
    assert run.history[-1]["name"] == "s" and run.history[-1]["first_step"] == 5
    assert run.history[-1]["schedule"] == {"from": 4, "steps": 8} and run.history[-1]["lr"] == in_force
    assert recipe.step_scheduler.stop_at is None and said[0].startswith("Stage 's' begins at step 5")


def test_a_stage_that_sets_optimizer_lr_starts_its_schedule_from_it(tmp_path):
    run, recipe, optimizer, _ = _staged_recipe(tmp_path, {"optimizer.lr": 0.002})
    run.restored(recipe)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.002 * 0.5)  # warmup_cosine's warmup: it says otherwise
    assert optimizer.param_groups[0]["initial_lr"] == 0.002


def test_a_stage_that_sets_no_schedule_keeps_the_one_in_force(tmp_path):
    run, recipe, optimizer, _ = _staged_recipe(tmp_path, {"step_scheduler.global_batch_size": 8})
    schedule, lr = recipe.lr_scheduler, optimizer.param_groups[0]["lr"]
    run.restored(recipe)
    assert recipe.lr_scheduler is schedule and optimizer.param_groups[0]["lr"] == lr
    assert run.history[-1]["schedule"] == run.history[0]["schedule"]


def test_a_stage_longer_than_the_models_positions_is_refused_once_the_model_is_built(tmp_path):
    import types

    import yaml

    from automodel_ckpt.config.loader import load_config
    from automodel_ckpt.config.schema import RecipeConfig
    from automodel_ckpt.config.stages import StagePlan
    from automodel_ckpt.errors import ConfigError
    from automodel_ckpt.recipes.stages import StageRun

    recipe = {"data": {"seq_length": 32}, "step_scheduler": {"max_steps": 12},
              "stages": [{"name": "long", "at_step": 4, "set": {"data.seq_length": 96}}]}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    plan = StagePlan.of(load_config(tmp_path / "r.yaml", [], RecipeConfig))
    model = types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=64))
    with pytest.raises(ConfigError) as err:
        StageRun(plan.config(0), plan, 0).built(model, {}, lambda cfg: {})
    assert str(err.value) == ("stages[0] (long): data.seq_length (96) is longer than the model's positions "
                              "(max_position_embeddings 64)")
    model.config.max_position_embeddings = 96
    StageRun(plan.config(0), plan, 0).built(model, {}, lambda cfg: {})


def test_a_launch_guesses_its_stage_from_the_checkpoint_it_will_resume(tmp_path):
    import json
    import types

    from automodel_ckpt.recipes.stages import _resumed_step

    run = tmp_path / "run"
    for step in (3, 6):
        (run / f"epoch_0_step_{step}").mkdir(parents=True)
        (run / f"epoch_0_step_{step}" / "metadata.json").write_text(json.dumps({"step": step}))
    (run / "LATEST").symlink_to("epoch_0_step_6")

    def ckpt(**keys):
        return types.SimpleNamespace(**({"checkpoint_dir": str(run), "staging_dir": None, "restore_from": None,
                                         "load_only": None} | keys))

    assert _resumed_step(ckpt()) == 6
    assert _resumed_step(ckpt(restore_from="epoch_0_step_3")) == 3
    assert _resumed_step(ckpt(restore_from=str(run / "epoch_0_step_3"))) == 3
    assert _resumed_step(ckpt(restore_from="/elsewhere/x", load_only=["model"])) == 6  # its own checkpoints first
    (run / "epoch_0_step_6" / "metadata.json").write_text('{"step": "six"}')
    assert _resumed_step(ckpt()) == 0  # a guess: the restore checks it, and the launch is built again if wrong
    assert _resumed_step(ckpt(checkpoint_dir=str(tmp_path / "none"))) == 0


def test_a_new_stage_may_bring_a_schedule_of_another_kind_than_the_one_saved(tmp_path):
    from automodel_ckpt.training.lr import cooldown

    run, recipe, optimizer, _ = _staged_recipe(tmp_path, {"lr_scheduler": {
        "_target_": "automodel_ckpt.training.lr.warmup_cosine", "warmup_steps": 1}})
    saved = cooldown(optimizer, 12, steps=8, final_lr=0.0).state_dict()  # the stage before ended on a cooldown
    run.hold(recipe)
    recipe.lr_scheduler.load_state_dict(saved)  # as the restore loads it: held, not loaded
    run.restored(recipe)
    assert type(recipe.lr_scheduler).__name__ == "LambdaLR" and run.history[-1]["schedule"]["from"] == 4


def test_a_saved_schedule_of_another_kind_than_the_recipes_is_one_line(tmp_path):
    from automodel_ckpt.errors import CheckpointError
    from automodel_ckpt.training.lr import cooldown

    run, recipe, optimizer, _ = _staged_recipe(tmp_path, {"step_scheduler.global_batch_size": 8})
    run.history = []
    saved = cooldown(optimizer, 12, steps=8, final_lr=0.0).state_dict()
    run.hold(recipe)
    recipe.lr_scheduler.load_state_dict(saved)
    with pytest.raises(CheckpointError, match="is not this recipe's lr_scheduler .*--checkpoint.new_stage NAME"):
        run.restored(recipe)
