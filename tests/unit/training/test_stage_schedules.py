"""What a stage changes at run time (docs/stages.md): its schedules (``cooldown``, ``wsd``), where the step scheduler
ends a stage, and the stages a checkpoint lists, read back field by field (untrusted)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from automodel_ckpt.errors import CheckpointError
from automodel_ckpt.training.lr import cooldown, wsd
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
