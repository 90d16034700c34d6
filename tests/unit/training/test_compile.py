"""``training.compile``: off on CPU and on on CUDA under auto, as the recipe says, with one line saying why."""

from __future__ import annotations

import pytest
import torch

from automodel_ckpt.errors import ConfigError
from automodel_ckpt.training.compile import decide


@pytest.mark.parametrize("setting,device,on", [("auto", "cpu", False), ("auto", "cuda", True), (True, "cpu", True),
                                               ("true", "cuda", True), (False, "cuda", False), ("False", "cpu", False)])
def test_whether_blocks_are_compiled(setting, device, on):
    chosen, line = decide(setting, torch.device(device))
    assert chosen is on
    assert line.startswith(f"torch.compile: {'on' if on else 'off'} (")


def test_an_unknown_setting_is_one_line():
    with pytest.raises(ConfigError, match="training.compile: expected auto, true or false, got 'sometimes'"):
        decide("sometimes", torch.device("cpu"))
