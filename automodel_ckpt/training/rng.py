"""Python, NumPy and torch (CPU and CUDA) generator state as one checkpointable object."""

from __future__ import annotations

import hashlib
import random
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@contextmanager
def rng_untouched() -> Iterator[None]:
    """Python, NumPy and torch generators leave the block as they entered it (work done once or on some ranks)."""
    saved = RNGState().state_dict()
    try:
        yield
    finally:
        RNGState().load_state_dict(saved)


class RNGState:
    """Saved per data-parallel rank (its tensor-parallel peers draw alike): generators continue exactly."""

    checkpoint_scope = "rank"

    def state_dict(self) -> dict[str, Any]:
        np_state = np.random.get_state()
        state: dict[str, Any] = {
            "python": random.getstate(),
            "numpy": {"name": np_state[0], "keys": torch.from_numpy(np_state[1].copy()), "pos": int(np_state[2]),
                      "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        py = state["python"]
        random.setstate((py[0], tuple(py[1]), py[2]))
        n = state["numpy"]
        np.random.set_state((n["name"], n["keys"].numpy(), n["pos"], n["has_gauss"], n["cached_gaussian"]))
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])

    def reshard_state(self, saved: Callable[[int], dict[str, Any]], saved_world_size: int, rank: int,
                      world_size: int) -> dict[str, Any]:
        """A rank that existed at the save keeps its generators; a new one (the job grew) is seeded from a hash of
        rank 0's saved torch state and its rank: deterministic, different per rank and per checkpoint."""
        if rank < saved_world_size:
            return saved(rank)
        reference = saved(0)["torch"]
        digest = hashlib.sha256(reference.numpy().tobytes() + rank.to_bytes(4, "little")).digest()
        seed_everything(int.from_bytes(digest[:8], "little"))
        return self.state_dict()
