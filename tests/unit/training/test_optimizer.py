"""The optimizer runs the fastest implementation torch has unless the recipe names one, and its checkpoints
resume under any implementation."""

from __future__ import annotations

import pytest
import torch

from automodel_ckpt.training.optimizer import implementation


def _params() -> list[torch.nn.Parameter]:
    return list(torch.nn.Linear(4, 3).parameters())


def test_adamw_on_cpu_runs_fused_by_default_and_says_so():
    kwargs, line = implementation(torch.optim.AdamW, {"lr": 1e-3}, _params())
    assert kwargs == {"fused": True}
    assert line.startswith("Optimizer: AdamW, fused implementation")


@pytest.mark.parametrize("settings,which", [({"fused": False}, "single-tensor"), ({"foreach": True}, "foreach"),
                                            ({"fused": True}, "fused"), ({"fused": False, "foreach": False},
                                                                         "single-tensor")])
def test_the_recipe_s_choice_wins(settings, which):
    kwargs, line = implementation(torch.optim.AdamW, settings, _params())
    assert kwargs == {}
    assert f"{which} implementation (set by optimizer." in line


def test_integer_parameters_or_other_optimizers_get_no_fused_kernel():
    ints = [torch.zeros(3, dtype=torch.int64)]
    assert implementation(torch.optim.AdamW, {}, ints)[0] == {"foreach": True}
    assert implementation(torch.optim.RMSprop, {}, _params())[0] == {"foreach": True}  # no fused RMSprop
    assert implementation(torch.optim.Adam, {}, [])[0] == {"foreach": True}
    assert implementation(torch.optim.LBFGS, {}, _params()) == ({}, "Optimizer: LBFGS")  # takes neither


def test_sharded_parameters_get_fused_kernels_only_where_torch_can_shard_them(process_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    sharded = [torch.nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]))]
    assert implementation(torch.optim.AdamW, {}, sharded)[0] == {"fused": True}
    assert implementation(torch.optim.SGD, {}, sharded)[0] == {"foreach": True}  # no sharding rule for fused SGD
    torch.optim.SGD(sharded, lr=0.1, foreach=True)  # constructs
    assert implementation(torch.optim.SGD, {}, _params())[0] == {"fused": True}


def _train(opt_kwargs: dict, model: torch.nn.Module, steps: int, state: dict | None = None) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **opt_kwargs)
    if state is not None:
        opt.load_state_dict(state)
    x = torch.linspace(-1, 1, 8).view(2, 4)
    for _ in range(steps):
        model(x).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return opt


@pytest.mark.parametrize("before,after", [({"fused": False, "foreach": False}, {"fused": True}),
                                          ({"fused": True}, {"fused": False, "foreach": False})])
def test_a_checkpoint_of_one_implementation_resumes_under_the_other(before, after):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    straight = torch.nn.Linear(4, 3)
    straight.load_state_dict(model.state_dict())
    saved = _train(before, model, 3).state_dict()
    assert set(saved["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}  # the same layout whatever the kernel
    _train(after, model, 2, state=saved)
    _train(before, straight, 5)
    for a, b in zip(model.parameters(), straight.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
