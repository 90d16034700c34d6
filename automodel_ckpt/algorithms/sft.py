"""Supervised fine-tuning as an algorithm: each label token's next-token loss over the tokenized data."""

from __future__ import annotations

import warnings

import torch

from automodel_ckpt.algorithms.base import Algorithm, Data, Numbers
from automodel_ckpt.algorithms.context import LossResult, TrainContext
from automodel_ckpt.data import IGNORE_INDEX, MicroBatch, prepare_data, validation_batches
from automodel_ckpt.distributed.env import barrier
from automodel_ckpt.errors import ConfigError
from automodel_ckpt.training.loss import next_token_loss_sum


def supervised_data(ctx: TrainContext) -> Data:
    """The tokenized training rows and this rank's held-out batches: every held-out row once over the data-parallel
    ranks. Rank 0 tokenizes first (into the cache); the other ranks then read its result."""
    main = ctx.env.is_main
    if not main:
        barrier()
    prepared = prepare_data(ctx.cfg, ctx.tokenizer, ctx.processor)
    if main:
        barrier()
    if prepared.warning and main:
        warnings.warn(prepared.warning, stacklevel=3)
    train, batch = prepared.train, ctx.cfg.step_scheduler.global_batch_size
    if len(train) < batch:
        raise ConfigError(f"step_scheduler.global_batch_size: {batch} is larger than the training set "
                          f"({len(train)} sequences)")
    val = prepared.validation
    batches = validation_batches(val, local_batch_size=ctx.cfg.step_scheduler.local_batch_size,
                                 rank=ctx.dims.dp_rank, world_size=ctx.dims.dp_size) if val is not None and len(val) \
        else None
    return Data(train, batches, prepared.report())


class Supervised(Algorithm):
    """Supervised fine-tuning: the batches are the tokenized rows, the loss each label token's next-token loss
    (``training.loss``; labels ``IGNORE_INDEX`` left out), the mean over the global batch's label tokens."""

    def build_data(self) -> Data:
        return supervised_data(self.ctx)

    def loss_count(self, mb: MicroBatch) -> torch.Tensor:
        """The loss is the mean over the batch's label tokens."""
        return (mb.labels[:, 1:] != IGNORE_INDEX).sum()

    def loss_target(self, mb: MicroBatch) -> torch.Tensor:
        """The labels."""
        return mb.labels

    def compute_loss(self, logits: torch.Tensor, target: torch.Tensor) -> LossResult:
        return LossResult(next_token_loss_sum(logits, target.to(logits.device), IGNORE_INDEX))

    @torch.no_grad()
    def validate(self, batches: list[MicroBatch]) -> Numbers:
        """The validation loss: the mean over every label token of the held-out batches."""
        ctx = self.ctx
        ctx.model.eval()
        loss_sum = torch.zeros((), dtype=torch.float64)
        tokens = 0
        for mb in batches:
            loss_sum += ctx.forward.evaluate(mb, mb.labels)[0]
            tokens += int((mb.labels[:, 1:] != IGNORE_INDEX).sum())
        loss_sum = ctx.dims.sum_over_stages(loss_sum)  # the last stage's (zero on the others)
        totals = ctx.dims.sum_over_dp(torch.stack([loss_sum, torch.tensor(float(tokens), dtype=torch.float64)]))
        return Numbers((totals[0] / max(totals[1].item(), 1.0)).item(), {})

    def step_done(self, loss: float, global_count: float, sums: list[torch.Tensor | None]) -> Numbers:
        return Numbers(loss, {})
