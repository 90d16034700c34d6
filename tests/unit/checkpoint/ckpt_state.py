"""A small training state for checkpointer unit tests: model, optimizer, a global and a per-rank object."""

from __future__ import annotations

import torch
from torch import nn


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, sd):
        self.n = sd["n"]


class RankCounter(Counter):
    checkpoint_scope = "rank"


class State:
    """What a recipe would checkpoint: model, optimizer, a global and a per-rank object."""

    def __init__(self, hidden: int = 8, layers: int = 2, seed: int = 0) -> None:
        torch.manual_seed(seed)
        mods = [nn.Linear(4, hidden)] + [nn.Linear(hidden, hidden) for _ in range(layers - 2)] + [nn.Linear(hidden, 2)]
        self.model = nn.Sequential(*mods)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.counter = Counter()
        self.cursor = RankCounter()

    def step(self) -> None:
        self.model(torch.randn(3, 4)).sum().backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.counter.n += 1
        self.cursor.n += 10

    def states(self):
        return {"model": self.model, "optimizer": self.optimizer, "counter": self.counter, "cursor": self.cursor}

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Copies of every parameter and optimizer state tensor."""
        out = {f"p.{k}": v.detach().clone() for k, v in self.model.state_dict().items()}
        for i, st in enumerate(self.optimizer.state.values()):
            out |= {f"o{i}.{k}": torch.as_tensor(v).clone() for k, v in st.items()}
        return out
