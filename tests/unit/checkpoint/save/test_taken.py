"""taken: a small state taken at the save serializes later to what torch.save wrote at the save."""

from __future__ import annotations

import io
import random

import torch

from automodel_ckpt.checkpoint.save.taken import Taken
from automodel_ckpt.training.rng import RNGState


def _saved(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def test_bytes_are_torch_saves_of_the_value_when_taken() -> None:
    live = {"counter": torch.zeros(3), "weight": torch.nn.Parameter(torch.ones(2)), "names": ["a", "b"],
            "step": 7, "nested": {"t": torch.arange(4), "same": None}}
    live["nested"]["same"] = live["counter"]  # one tensor twice: one storage, as torch.save writes it
    expected = _saved(live)
    taken = Taken(live)
    live["counter"] += 5  # the state goes on changing after the save
    live["names"].append("c")
    live["step"] = 8
    assert taken.bytes() == expected
    assert taken.bytes() == expected  # as often as asked


def test_the_rng_state_of_the_save() -> None:
    rng = RNGState()
    expected = _saved(rng.state_dict())
    taken = Taken(rng.state_dict())
    random.random(), torch.rand(3)
    assert taken.bytes() == expected
