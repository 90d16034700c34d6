"""state_dicts: the model's and optimizer's state dicts taken again from a kept layout are torch's, and torch is asked
again whenever the layout no longer fits."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from automodel_ckpt.ondisk.formats import state_dicts


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.body = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 8))
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, x):
        return self.body(self.embed(x)).sum() + self.head(self.embed(x)).sum()


def _stepped(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.tensor([1, 2, 3])).backward()
    optimizer.step()
    optimizer.zero_grad()


def _same(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for key, value in b.items():
        if isinstance(value, dict):
            _same(a[key], value)
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            assert len(a[key]) == len(value)
            for x, y in zip(a[key], value):
                _same(x, y)
        elif isinstance(value, torch.Tensor):
            assert a[key].data_ptr() == value.data_ptr() and a[key].shape == value.shape
        else:
            assert a[key] == value


def test_taken_again_they_are_torchs_answers_with_live_values() -> None:
    model = _Net()
    optimizer = torch.optim.AdamW([{"params": list(model.body.parameters())},
                                   {"params": [model.embed.weight], "lr": 0.5}])
    _stepped(model, optimizer)
    for _ in range(3):  # the first call asks torch and keeps the layout; the next ones rebuild from it
        _same(state_dicts.model_state_dict(model), get_model_state_dict(model))
        _same(state_dicts.optimizer_state_dict(model, optimizer), get_optimizer_state_dict(model, optimizer))
    optimizer.param_groups[0]["lr"] = 0.125  # a scheduler's change shows at once
    assert state_dicts.optimizer_state_dict(model, optimizer)["param_groups"][0]["lr"] == 0.125
    assert state_dicts._OPTIMIZERS[optimizer] is not state_dicts._NEVER


def test_a_changed_layout_asks_torch_again() -> None:
    model = _Net()
    optimizer = torch.optim.SGD(model.body.parameters(), lr=0.1, momentum=0.9)
    assert state_dicts.optimizer_state_dict(model, optimizer)["state"]  # no state yet: torch makes it
    _stepped(model, optimizer)
    state_dicts.optimizer_state_dict(model, optimizer)
    optimizer.add_param_group({"params": [model.embed.weight], "lr": 0.01})
    _stepped(model, optimizer)
    _same(state_dicts.optimizer_state_dict(model, optimizer), get_optimizer_state_dict(model, optimizer))
    model.extra = nn.Linear(2, 2)  # a module added: new keys
    _same(state_dicts.model_state_dict(model), get_model_state_dict(model))
    assert "extra.weight" in state_dicts.model_state_dict(model)


def test_a_compiled_models_names_are_torchs() -> None:
    model = _Net()
    wrapper = torch.compile(model)  # not run: only its wrapper's ``_orig_mod.`` prefix, which torch drops
    optimizer = torch.optim.Adam(model.parameters())
    _stepped(model, optimizer)
    for _ in range(2):
        _same(state_dicts.model_state_dict(wrapper), get_model_state_dict(wrapper))
        _same(state_dicts.optimizer_state_dict(wrapper, optimizer), get_optimizer_state_dict(wrapper, optimizer))
    assert "embed.weight" in state_dicts.model_state_dict(wrapper)


def test_an_optimizer_with_state_dict_hooks_is_always_asked_of_torch() -> None:
    model = _Net()
    optimizer = torch.optim.Adam(model.parameters())
    optimizer.register_state_dict_post_hook(lambda opt, sd: sd)
    _stepped(model, optimizer)
    state_dicts.optimizer_state_dict(model, optimizer)
    assert state_dicts._OPTIMIZERS[optimizer] is state_dicts._NEVER
