"""A resumable loader whose position is global: epoch + samples consumed in a seeded, rank-independent order."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from automodel_ckpt.data.tokenize import IGNORE_INDEX, TokenizedData


@dataclass
class MicroBatch:
    """Rows of one forward pass; ``position_ids``: packed rows only; ``pixel_values``: image records only."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor
    sample_ids: torch.Tensor
    position_ids: torch.Tensor | None = None
    pixel_values: torch.Tensor | None = None


def micro_batch(data: TokenizedData, idx: torch.Tensor) -> MicroBatch:
    rows = data.batch(idx)
    return MicroBatch(rows["input_ids"], rows["labels"], rows["attention_mask"], data.sample_ids[idx],
                      rows["position_ids"], rows.get("pixel_values"))


class GlobalPosition:
    """A loader whose position is global, the same on every rank: nothing to add per step or to a checkpoint."""

    def report(self, waited: float) -> dict[str, Any]:
        return {}

    def summary(self) -> dict[str, Any] | None:
        return None

    def reshard_state(self, saved: Callable[[int], dict[str, Any]], saved_world_size: int, rank: int,
                      world_size: int) -> dict[str, Any]:
        """At another world size every rank takes rank 0's position: it is global, not per rank."""
        return saved(0)


class GlobalBatchLoader(GlobalPosition):
    """Per optimizer step, this rank's micro-batches of one global batch: the next ``global_batch_size`` rows of epoch
    ``e``'s ``randperm(n, seed + e)`` order, each micro-step's ``r``-th slice to data-parallel rank ``r``. The state is
    ``(epoch, position)``, the same on every rank, so a resume at another world size sees the same samples. An
    incomplete last global batch of an epoch is skipped."""

    checkpoint_scope = "rank"

    def __init__(self, data: TokenizedData, *, global_batch_size: int, local_batch_size: int, rank: int,
                 world_size: int, seed: int, shuffle: bool = True) -> None:
        self.data, self.global_batch_size, self.local_batch_size = data, global_batch_size, local_batch_size
        self.rank, self.world_size, self.seed, self.shuffle = rank, world_size, seed, shuffle
        self.grad_accum = global_batch_size // (local_batch_size * world_size)
        self.epoch = 0
        self.position = 0
        self._order: torch.Tensor | None = None
        self._order_epoch = -1
        self.last_sample_ids: list[int] = []

    @property
    def steps_per_epoch(self) -> int:
        return len(self.data) // self.global_batch_size

    def _epoch_order(self) -> torch.Tensor:
        if self._order_epoch != self.epoch:
            n = len(self.data)
            self._order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + self.epoch)) \
                if self.shuffle else torch.arange(n)
            self._order_epoch = self.epoch
        assert self._order is not None
        return self._order

    def next_batch(self) -> tuple[int, list[MicroBatch]]:
        """``(epoch, micro_batches)`` of the next optimizer step; advances the position."""
        if self.steps_per_epoch == 0:
            raise ValueError("the training set is smaller than one global batch")
        if self.position + self.global_batch_size > len(self.data):
            self.epoch += 1
            self.position = 0
        order = self._epoch_order()
        rows = order[self.position : self.position + self.global_batch_size]
        per_micro = self.local_batch_size * self.world_size
        micro = []
        for i in range(self.grad_accum):
            start = i * per_micro + self.rank * self.local_batch_size
            idx = rows[start : start + self.local_batch_size]
            micro.append(micro_batch(self.data, idx))
        epoch = self.epoch
        self.last_sample_ids = self.data.sample_ids[rows].tolist()
        self.position += self.global_batch_size
        return epoch, micro

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "global_batch_size": self.global_batch_size,
                "world_size": self.world_size, "rank": self.rank, "num_rows": len(self.data), "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._saved_rows = (state.get("num_rows"), state.get("seed"))

    def steps_left(self, num_epochs: int) -> int:
        """Optimizer steps left until ``num_epochs`` epochs are served, at this global batch, from the position."""
        this_epoch = (len(self.data) - self.position) // self.global_batch_size
        return max(0, this_epoch + (num_epochs - 1 - self.epoch) * self.steps_per_epoch)

    def begin_stage(self) -> str | None:
        """A new stage goes on from the position; other training rows start at their beginning (said)."""
        rows, seed = getattr(self, "_saved_rows", (len(self.data), self.seed))
        if (rows, seed) == (len(self.data), self.seed):
            return None
        self.epoch, self.position = 0, 0
        return f"the training rows changed ({rows} -> {len(self.data)}): they start at their beginning, epoch 0"


def validation_batches(data: TokenizedData, *, local_batch_size: int, rank: int, world_size: int) -> list[MicroBatch]:
    """Every validation row once over all ranks (``strided_rows``), the filling rows' labels all ignored."""
    batches = []
    for b, keep in strided_rows(len(data), local_batch_size=local_batch_size, rank=rank, world_size=world_size):
        mb = micro_batch(data, b)
        mb.labels[~keep] = IGNORE_INDEX
        batches.append(mb)
    return batches


def strided_rows(n: int, *, local_batch_size: int, rank: int, world_size: int
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s rows ``rank, rank+W, ...`` in batches, as many on every rank (row 0 fills; the mask: own)."""
    per_rank = -(-n // world_size)
    idx = torch.arange(rank, n, world_size)
    real = torch.ones(per_rank, dtype=torch.bool)
    real[len(idx):] = False
    idx = torch.cat([idx, torch.zeros(per_rank - len(idx), dtype=torch.long)])
    return list(zip(idx.split(local_batch_size), real.split(local_batch_size)))
