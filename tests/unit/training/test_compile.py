"""``training.compile``: under auto, on with CUDA, and on CPU only for a step (and a run) with enough matrix work to
repay compiling, with one line saying why."""

from __future__ import annotations

import pytest
import torch

from automodel_ckpt.errors import ConfigError
from automodel_ckpt.training.compile import CPU_RUN_FLOP, CPU_STEP_FLOP, decide, step_flop


@pytest.mark.parametrize("setting,device,on", [("auto", "cpu", False), ("auto", "cuda", True), (True, "cpu", True),
                                               ("true", "cuda", True), (False, "cuda", False), ("False", "cpu", False)])
def test_whether_blocks_are_compiled(setting, device, on):
    chosen, line = decide(setting, torch.device(device))
    assert chosen is on
    assert line.startswith(f"torch.compile: {'on' if on else 'off'} (")


def test_an_unknown_setting_is_one_line():
    with pytest.raises(ConfigError, match="training.compile: expected auto, true or false, got 'sometimes'"):
        decide("sometimes", torch.device("cpu"))


@pytest.mark.parametrize("parameters,tokens,steps,on,why", [
    (200_000, 4 * 64, 40, False, "below 1e+11: compiling costs more"),  # the suite's tiny models
    (26_100_000, 2048, None, True, "3.2e+11 FLOP a step: 3 to 5% off"),  # a 26M Llama, run by epochs
    (26_100_000, 2048, 300, False, "9.6e+13 FLOP over 300 steps, below 3e+14: too short"),
    (26_100_000, 2048, 1000, True, "3.2e+14 over 1000 steps"),
    (121_300_000, 2048, 250, True, "3.7e+14 over 250 steps"),
])
def test_auto_on_cpu_compiles_steps_and_runs_with_enough_work(parameters, tokens, steps, on, why):
    work = step_flop(parameters, tokens)
    assert (work >= CPU_STEP_FLOP and (steps is None or work * steps >= CPU_RUN_FLOP)) is on
    chosen, line = decide("auto", torch.device("cpu"), work, steps)
    assert chosen is on
    assert line.startswith(f"torch.compile: {'on' if on else 'off'} (auto on CPU: ") and why in line
