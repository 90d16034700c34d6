"""Other trainers' schedules, names and pickles: our schedules equal theirs step by step, the Trainer's optimizer order,
and the readers refuse what a checkpoint of numbers does not hold."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from automodel_ckpt.errors import CheckpointError, ConfigError
from automodel_ckpt.interop import names, schedules
from automodel_ckpt.interop.source import Limits, load_pickle, load_record, read_bytes

TOTAL = 23


def _torch_factors(scheduler, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        out.append(scheduler.optimizer.param_groups[0]["lr"] / scheduler.base_lrs[0])
        scheduler.optimizer.step()
        scheduler.step()
    return out


def _optimizer() -> torch.optim.Optimizer:
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=0.25)


@pytest.mark.parametrize("kind,kwargs", [("linear", {}), ("cosine", {}), ("constant", {}),
                                         ("constant_with_warmup", {}), ("cosine_with_min_lr", {"min_lr_rate": 0.1}),
                                         ("cosine_with_min_lr", {"min_lr": 0.05})])
def test_the_hf_trainer_schedules_are_ours_step_by_step(kind, kwargs):
    from transformers import get_scheduler

    theirs = get_scheduler(kind, _optimizer(), num_warmup_steps=5, num_training_steps=TOTAL,
                           scheduler_specific_kwargs=kwargs or None)
    ours = schedules.from_hf_trainer({"lr_scheduler_type": kind, "warmup_steps": 5, "learning_rate": 0.25,
                                      "lr_scheduler_kwargs": kwargs}, TOTAL)
    want = _torch_factors(theirs, TOTAL)
    assert want[0] == 0.0 or kind == "constant"  # the Trainer's warmup starts at lr 0
    assert [schedules.factor(ours, s) for s in range(TOTAL)] == pytest.approx(want, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("make", [
    lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=9, eta_min=0.01),
    lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.2, end_factor=0.9, total_iters=7),
    lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=4, gamma=0.5),
])
def test_torch_schedulers_from_their_state_are_ours(make):
    theirs = make(_optimizer())
    ours = schedules.from_torch_state(theirs.state_dict(), None)
    want = _torch_factors(theirs, TOTAL)
    assert [schedules.factor(ours, s) for s in range(TOTAL)] == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("kwargs", [{}, {"anneal_strategy": "linear", "three_phase": True, "pct_start": 0.2},
                                    {"cycle_momentum": False, "div_factor": 10.0, "final_div_factor": 100.0}])
def test_one_cycle_lr_continues_as_ours_lr_and_beta1(kwargs):
    """torch's OneCycleLR and ours step side by side: the same lr and beta1 after every step, and ours read from a
    checkpoint of torch's at step 9 goes on as torch's does. At ``TOTAL``, a step torch never trains with, torch
    goes on past its last phase (below 0 when linear) and ours holds its last lr."""
    from automodel_ckpt.training.lr import one_cycle

    theirs_opt = _optimizer()
    theirs = torch.optim.lr_scheduler.OneCycleLR(theirs_opt, max_lr=1.0, total_steps=TOTAL, **kwargs)
    schedule = schedules.from_torch_state(theirs.state_dict(), None, theirs_opt.param_groups[0])
    assert schedule.target.endswith(".one_cycle") and schedule.total_steps == TOTAL
    assert ("momenta" in schedule.kwargs) == kwargs.get("cycle_momentum", True)
    ours_opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=theirs.base_lrs[0])
    ours = one_cycle(ours_opt, TOTAL, **schedule.kwargs)
    for step in range(TOTAL + 1):
        group, mine = theirs_opt.param_groups[0], ours_opt.param_groups[0]
        if step == TOTAL:
            assert mine["lr"] == last
            break
        assert mine["lr"] == pytest.approx(group["lr"], rel=1e-12), step
        assert mine["betas"] == pytest.approx(group["betas"], rel=1e-12), step
        assert schedules.factor(schedule, step) * theirs.base_lrs[0] == pytest.approx(group["lr"], rel=1e-12)
        last = mine["lr"]
        for opt, sched in ((theirs_opt, theirs), (ours_opt, ours)):
            opt.step()
            sched.step()
    schedules.check_recipe_schedule(schedule, ours, TOTAL)  # the recipe's section is the source's
    state = ours.state_dict()
    assert "beta1" not in state and set(state) >= {"last_epoch", "base_lrs"}


@pytest.mark.parametrize("kind,total", [("WarmupLR", {}), ("WarmupDecayLR", {"total_num_steps": 20})])
def test_a_deepspeed_warmup_saved_inside_it_continues_exactly(kind, total):
    """DeepSpeed's own scheduler, stepped as its engine steps it (once after each optimizer step) and saved at
    step 6 of a 10-step linear warmup: ours, read from its state, has its lr at every later step, inside the
    warmup (7-11) and after it, to the end of a decay (the import's max_steps)."""
    from automodel_ckpt.interop.deepspeed import _schedule

    lr_schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")
    params = {"warmup_min_lr": 0.01, "warmup_max_lr": 0.25, "warmup_num_steps": 10, "warmup_type": "linear", **total}
    opt = _optimizer()
    theirs = getattr(lr_schedules, kind)(opt, **params)
    used = {}
    for step in range(1, TOTAL + 1):
        used[step] = opt.param_groups[0]["lr"]
        opt.step()
        theirs.step()
        if step == 6:
            saved, groups = theirs.state_dict(), [{"lr": opt.param_groups[0]["lr"]}]
    schedule = _schedule({"type": kind, "params": params}, saved, 6, groups, {}, Path("global_step6"), [])
    assert groups[0]["initial_lr"] == 0.25 and schedule.total_steps == total.get("total_num_steps")
    steps = range(7, total.get("total_num_steps", TOTAL) + 1)
    ours = [schedules.factor(schedule, step - 1) * 0.25 for step in steps]
    assert ours == pytest.approx([used[step] for step in steps], rel=1e-12, abs=1e-15)


def test_a_recipe_without_one_cycle_beta1_is_refused():
    theirs_opt = _optimizer()
    theirs = torch.optim.lr_scheduler.OneCycleLR(theirs_opt, max_lr=1.0, total_steps=TOTAL)
    schedule = schedules.from_torch_state(theirs.state_dict(), None, theirs_opt.param_groups[0])
    from automodel_ckpt.training.lr import one_cycle

    lr_only = one_cycle(_optimizer(), TOTAL, **{k: v for k, v in schedule.kwargs.items() if k != "momenta"})
    with pytest.raises(ConfigError, match="recipe's beta1 at step 0 is fixed, the source's 0.95: write "
                                          "lr_scheduler: {_target_: automodel_ckpt.training.lr.one_cycle"):
        schedules.check_recipe_schedule(schedule, lr_only, TOTAL)


def test_a_schedule_without_a_counterpart_and_a_recipe_with_another_are_one_line():
    cyclic = torch.optim.lr_scheduler.CyclicLR(_optimizer(), base_lr=0.1, max_lr=1.0, cycle_momentum=False)
    assert schedules.from_torch_state(cyclic.state_dict(), None).target is None
    assert schedules.from_hf_trainer({"lr_scheduler_type": "polynomial"}, 10).target is None
    linear = schedules.from_hf_trainer({"lr_scheduler_type": "linear", "warmup_steps": 2}, 10)
    from automodel_ckpt.training.lr import warmup_cosine

    with pytest.raises(ConfigError, match=r"write lr_scheduler: \{_target_: automodel_ckpt.training.lr.linear_decay"):
        schedules.check_recipe_schedule(linear, warmup_cosine(_optimizer(), 10, warmup_steps=2), 10)
    with pytest.raises(ConfigError, match="set --step_scheduler.max_steps 10"):
        schedules.check_recipe_schedule(linear, warmup_cosine(_optimizer(), 12), 12)


def test_the_hf_trainer_order_is_its_decay_groups():
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer

    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, attention_bias=True))
    decay = set(Trainer.get_decay_parameter_names(None, model))
    named = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names.hf_trainer_order(model) == [n for n in named if n in decay] + [n for n in named if n not in decay]
    assert any("bias" in n for n in named) and any("norm" in n for n in named)


class _Payload:
    def __reduce__(self):
        return (print, ("ran",))


def test_the_pickle_readers_refuse_code_and_bound_sizes(tmp_path):
    bad = tmp_path / "scheduler.pt"
    torch.save({"last_epoch": 1, "x": _Payload()}, bad)
    with pytest.raises(CheckpointError, match="Unsupported global"):
        load_pickle(bad, "the scheduler's state", 1 << 20)
    with pytest.raises(CheckpointError, match="over the"):
        load_pickle(bad, "the scheduler's state", 10)
    with pytest.raises(CheckpointError, match="names 'builtins.print'"):
        load_record(bad, "the Trainer's arguments")
    plain = tmp_path / "plain.pt"
    plain.write_bytes(pickle.dumps(_Payload()))
    with pytest.raises(CheckpointError, match="Unsupported operand"):
        load_pickle(plain, "x", 1 << 20)
    assert read_bytes(plain, "x", 1 << 20) == plain.read_bytes()


def test_an_rng_file_may_hold_numpy_state_and_nothing_else_of_numpy(tmp_path):
    import numpy as np

    path = tmp_path / "rng_state.pth"
    torch.save({"numpy": np.random.get_state(), "cpu": torch.get_rng_state()}, path)
    assert load_pickle(path, "rng", 1 << 20, numpy=True)["numpy"][0] == "MT19937"
    torch.save({"numpy": np.array([Path("/")], dtype=object)}, path)
    with pytest.raises(CheckpointError):
        load_pickle(path, "rng", 1 << 20, numpy=True)


def test_a_consolidated_lightning_optimizer_state_maps_its_slots_by_name(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from automodel_ckpt.interop.lightning import read_file

    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    named = [n for n, _ in model.named_parameters()][::-1]  # an order of its own: names decide
    params = dict(model.named_parameters())
    state = {f"model.{n}": {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(params[n]),
                            "exp_avg_sq": torch.zeros_like(params[n])} for n in named}
    group = {"lr": 0.1, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0, "params": [f"model.{n}" for n in named]}
    torch.save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}, "global_step": 1,
                "optimizer_states": [{"state": state, "param_groups": [group]}], "lr_schedulers": []},
               tmp_path / "last.ckpt")
    run = read_file(tmp_path / "last.ckpt", Limits(10**6))
    assert run.order(model) == named
    assert names.match_weights(model, list(run.weights), "x", adapter=False)["lm_head.weight"] == "model.lm_head.weight"


def test_import_passes_every_other_argument_to_the_recipe_a_whole_section_too():
    from automodel_ckpt.cli.import_run import parse_args

    section = "{_target_: automodel_ckpt.training.lr.linear_decay, warmup_steps: 2}"
    args = parse_args(["ckpt/checkpoint-6", "r.yaml", "--lr_scheduler", section, "--out", "run", "--data.shuffle",
                       "false"])
    assert (args.src, args.recipe, args.out) == ("ckpt/checkpoint-6", "r.yaml", "run")
    assert args.overrides == ["--lr_scheduler", section, "--data.shuffle", "false"]


def test_groups_that_differ_in_weight_decay_need_a_recipe_with_those_groups():
    """The HF Trainer's two groups with weight_decay > 0 on the first: a one-group recipe is refused in one line
    naming two parameters and the optimizer that has the groups; AdamWNoDecay takes them, each with its own."""
    from automodel_ckpt.interop.apply import _group_hypers, _optimizer_state
    from automodel_ckpt.interop.hf_trainer import optimizer_slots
    from automodel_ckpt.training.decay import AdamWNoDecay

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    weight, bias = model[0].weight, model[0].bias
    opt = torch.optim.AdamW([{"params": [weight], "weight_decay": 0.01}, {"params": [bias], "weight_decay": 0.0}])
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    moments, groups = optimizer_slots(opt.state_dict(), Path("optimizer.pt"))
    run = type("Run", (), {"order": staticmethod(names.hf_trainer_order), "moments": moments, "groups": groups})
    params = dict(model.named_parameters())
    state, group_of = _optimizer_state(run, model, params, "checkpoint-6")
    assert set(state) == {"0.weight", "0.bias"} and group_of == {"0.weight": 0, "0.bias": 1}
    one = torch.optim.AdamW(model.parameters(), weight_decay=0.01)
    with pytest.raises(CheckpointError, match=r"differ in weight_decay: '0.weight' has 0.01, '0.bias' 0.0, .* "
                                              r"group 0: optimizer._target_: .*decay.AdamWNoDecay"):
        _group_hypers(run, one, model, group_of, "checkpoint-6")
    members, hypers = _group_hypers(run, AdamWNoDecay(model.parameters(), weight_decay=0.5), model, group_of, "x")
    assert members == [["0.weight"], ["0.bias"]] and [h["weight_decay"] for h in hypers] == [0.01, 0.0]


def test_adamw_no_decay_has_the_hf_trainers_groups():
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer

    from automodel_ckpt.training.decay import AdamWNoDecay

    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, attention_bias=True))
    decay = set(Trainer.get_decay_parameter_names(None, model))
    name_of = {id(p): n for n, p in model.named_parameters()}
    opt = AdamWNoDecay(model.parameters(), weight_decay=0.1, lr=1e-3)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert {name_of[id(p)] for p in opt.param_groups[0]["params"]} == decay
    assert {name_of[id(p)] for p in opt.param_groups[1]["params"]} == set(name_of.values()) - decay
