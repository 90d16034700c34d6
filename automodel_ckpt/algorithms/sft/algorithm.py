"""Supervised fine-tuning as an algorithm: each label token's next-token loss over the tokenized data."""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch

from automodel_ckpt.algorithms.base import Algorithm, Data, Numbers
from automodel_ckpt.algorithms.context import LossResult, TrainContext
from automodel_ckpt.data import IGNORE_INDEX, GlobalBatchLoader, MicroBatch, build_streamed, is_streamed, \
    prepare_data, streamed_validation, validation_batches
from automodel_ckpt.distributed.collective import main_first
from automodel_ckpt.errors import ConfigError
from automodel_ckpt.training.loss import next_token_loss_sum


def rank_zero_first(ctx: TrainContext, make: Callable[[], Any]) -> Any:
    """``make()`` on rank 0 first (tokenizing into the cache), then on the others; a failure is every rank's."""
    return main_first(make, ctx.env.rank)


def map_loader(ctx: TrainContext, rows: Any, what: str) -> GlobalBatchLoader:
    """The loader of map-style ``rows`` (``what``: sequences, pairs) in global batches, this rank's share of each."""
    cfg, sched = ctx.cfg, ctx.cfg.step_scheduler
    if len(rows) < sched.global_batch_size:
        raise ConfigError(f"step_scheduler.global_batch_size: {sched.global_batch_size} is larger than the training "
                          f"set ({len(rows)} {what})")
    return GlobalBatchLoader(rows, global_batch_size=sched.global_batch_size, local_batch_size=sched.local_batch_size,
                             rank=ctx.dims.dp_rank, world_size=ctx.dims.dp_size, seed=cfg.seed,
                             shuffle=cfg.data.shuffle)


def supervised_data(ctx: TrainContext) -> Data:
    """The supervised rows' loader (streamed, or of the tokenized rows) and this rank's held-out batches."""
    cfg = ctx.cfg
    if is_streamed(cfg.dataset):
        loader, report = build_streamed(cfg, ctx.tokenizer, ctx.dims, log_ids=cfg.training.log_sample_ids)
        batches, held_out = streamed_validation(cfg, ctx.tokenizer, ctx.dims)
        return Data(loader, batches, report + held_out)
    prepared = rank_zero_first(ctx, lambda: prepare_data(cfg, ctx.tokenizer, ctx.processor))
    if prepared.warning and ctx.env.is_main:
        warnings.warn(prepared.warning, stacklevel=3)
    loader = map_loader(ctx, prepared.train, "sequences")
    val = prepared.validation
    batches = validation_batches(val, local_batch_size=cfg.step_scheduler.local_batch_size,
                                 rank=ctx.dims.dp_rank, world_size=ctx.dims.dp_size) if val is not None and len(val) \
        else None
    return Data(loader, batches, prepared.report())


class Supervised(Algorithm):
    """Supervised fine-tuning: the mean next-token loss over the global batch's label tokens (``training.loss``)."""

    def build_loader(self) -> Data:
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
