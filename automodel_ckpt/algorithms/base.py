"""The algorithm contract: what a fine-tune's algorithm (SFT, DPO, GRPO, ...) gives the recipe that holds it."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, ClassVar, Mapping, NamedTuple

import torch

from automodel_ckpt.algorithms.context import LossResult, TrainContext
from automodel_ckpt.config.instantiate import instantiate
from automodel_ckpt.data import BatchLoader, MicroBatch
from automodel_ckpt.distributed import data_parallel
from automodel_ckpt.distributed.pipeline import cut_stage
from automodel_ckpt.models.materialize import StartingWeights, builds_on_meta
from automodel_ckpt.training.rng import rng_untouched


class Data(NamedTuple):
    """An algorithm's loader (checkpointed as ``dataloader``), this rank's held-out batches and the report's line."""

    loader: BatchLoader
    validation: list[MicroBatch] | None
    report: str


class Numbers(NamedTuple):
    """A step's or a validation's loss, and the numbers logged beside it."""

    loss: float
    metrics: dict[str, Any]


class Algorithm:
    """What is trained, and how: the contract, with no behaviour of its own. ``FinetuneRecipe`` holds one, made
    from a ``TrainContext``, and keeps the mesh, the sharding, the step, the loop and the checkpointer.

    Each public attribute with ``state_dict`` is checkpointed under its name (but ``checkpoint_exclude``);
    ``bar_metrics`` are the metrics the progress bar shows."""

    checkpoint_exclude: frozenset[str] = frozenset({"ctx"})
    bar_metrics: ClassVar[tuple[str, ...]] = ()
    #: The config keys that change what the algorithm's saved state means (beside the recipe's).
    state_meaning: Mapping[str, Any] = MappingProxyType({})

    def __init__(self, ctx: TrainContext) -> None:
        self.ctx = ctx  # before the process group: the config checked, nothing built

    def build(self) -> None:
        """After the recipe's model, data and checkpointer are built: what else the algorithm trains with."""

    def restored(self, states: set[str]) -> None:
        """After the restore (``states``: those the checkpoint held): the algorithm's own state settled and checked."""

    def build_loader(self) -> Data:
        """The loader of the training batches, this rank's held-out batches and the report's line."""
        raise NotImplementedError

    def loss_count(self, mb: MicroBatch) -> torch.Tensor:
        """What the global batch's loss is the mean over, in this micro-batch."""
        raise NotImplementedError

    def loss_target(self, mb: MicroBatch) -> Any:
        """What ``compute_loss`` scores the logits against: a tensor, or named tensors with ``rows(index)``."""
        raise NotImplementedError

    def compute_loss(self, logits: torch.Tensor, target: Any) -> LossResult:
        """The summed loss of a batch's rows from the model's logits, and its metric sums."""
        raise NotImplementedError

    def pipeline_rows(self, mb: MicroBatch) -> torch.Tensor | None:
        """The order the pipeline takes a batch's rows in (None: as they are), keeping a pair in one microbatch."""
        return None

    def validate(self, batches: list[MicroBatch]) -> Numbers:
        """The held-out batches' loss and metrics."""
        raise NotImplementedError

    def step_done(self, loss: float, global_count: float, sums: list[torch.Tensor | None]) -> Numbers:
        """After the optimizer step (``sums``: this rank's loss calls'): the counters moved; the step's numbers."""
        raise NotImplementedError

    def save_extra(self) -> dict[str, Any]:
        """What each checkpoint's metadata records of the algorithm (its counters, under ``counters``)."""
        return {}


def frozen_copy(ctx: TrainContext) -> tuple[torch.nn.Module, StartingWeights]:
    """A frozen copy of the policy, built and sharded as it is, and the starting weights that fill it."""
    cfg, forward = ctx.cfg, ctx.forward
    weights = StartingWeights(cfg.model, ctx.env.rank, build_whole=lambda: instantiate(cfg.model, "model"))
    meta = builds_on_meta(cfg.model)
    with rng_untouched():
        ref = instantiate(cfg.model, "model", **({"on_meta": True} if meta else {}))
    if not meta:
        ref = ref.to(ctx.env.device)
    ref.requires_grad_(False)
    if forward.plan is not None:  # this rank's stage of it, cut as the policy's: whole-model names kept
        cut_stage(ref, forward.plan, ctx.dims.pp_rank, ctx.dims.pp_size)
    if forward.choice.sharded:
        ref = data_parallel.wrap(ref, forward.choice, ctx.dims)
    weights.materialize(ref, ctx.env.device)
    return ref.eval(), weights
