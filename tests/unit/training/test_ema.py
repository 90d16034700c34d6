"""The EMA of the trainable weights: the average's arithmetic, its state dict under the model's names, its refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from automodel_ckpt.errors import ConfigError
from automodel_ckpt.training.ema import EMA


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    model[0].bias.requires_grad_(False)  # frozen: not averaged
    return model


def test_the_state_dict_has_the_trainable_parameters_names_in_float32():
    model = _model().to(torch.bfloat16)
    ema = EMA(model, 0.9)
    state = ema.state_dict()
    assert list(state) == ["0.weight", "2.weight", "2.bias"] == ema.names
    assert all(t.dtype == torch.float32 for t in state.values())
    assert all(t.shape == model.state_dict()[k].shape for k, t in state.items())


def test_start_then_update_is_the_moving_average_bitwise():
    model, decay = _model(), 0.75
    ema = EMA(model, decay)
    ema.start(model)
    expected = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    for _ in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        ema.update(model)
        weights = dict(model.named_parameters())
        expected = {n: torch.lerp(e, weights[n].detach(), 1 - decay) for n, e in expected.items()}
    for name, value in ema.state_dict().items():
        assert torch.equal(value, expected[name]), name
        assert not torch.equal(value, dict(model.named_parameters())[name])


def test_load_state_dict_round_trips_into_the_same_tensors():
    model = _model()
    ema, other = EMA(model, 0.5), EMA(model, 0.5)
    ema.start(model)
    kept = [t.data_ptr() for t in other.averages()]
    other.load_state_dict(ema.state_dict())
    assert [t.data_ptr() for t in other.averages()] == kept  # the averages update() changes are the loaded ones
    assert all(torch.equal(a, b) for a, b in zip(ema.averages(), other.averages()))


@pytest.mark.parametrize("decay", [0, 1, 1.5, -0.1])
def test_a_decay_outside_zero_one_is_refused(decay):
    with pytest.raises(ConfigError, match="training.ema_decay"):
        EMA(_model(), decay)


def test_a_model_with_nothing_trainable_is_refused():
    model = _model().requires_grad_(False)
    with pytest.raises(ConfigError, match="no trainable parameter"):
        EMA(model, 0.9)
