"""rng_untouched: one-time work inside it leaves every generator where it was."""

from __future__ import annotations

import random

import numpy as np
import torch

from automodel_ckpt.training.rng import rng_untouched, seed_everything


def _draw() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), float(torch.rand(1))


def test_generators_continue_as_if_the_block_never_ran() -> None:
    seed_everything(7)
    expected = _draw()
    seed_everything(7)
    with rng_untouched():
        _draw()
        torch.nn.Linear(8, 8)  # module init draws from torch's generator
    assert _draw() == expected


def test_restored_even_when_the_block_raises() -> None:
    seed_everything(3)
    expected = _draw()
    seed_everything(3)
    try:
        with rng_untouched():
            _draw()
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert _draw() == expected
