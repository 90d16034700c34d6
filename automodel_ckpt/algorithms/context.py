"""What an algorithm trains with (``TrainContext``), given by the recipe that holds it: never the recipe itself."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from automodel_ckpt.data import IGNORE_INDEX, MicroBatch


@dataclass
class Run:
    """The run's services: its checkpoint section, a line said beside the progress bar, the async save's fence."""

    checkpoint: Any  # checkpoint.CheckpointConfig
    say: Callable[[str], None]
    fence: Callable[[], None]


@dataclass
class LossResult:
    """A batch's summed loss and the algorithm's metric sums of it (None: it has none)."""

    loss: torch.Tensor
    sums: torch.Tensor | None = None


@dataclass
class Forward:
    """How the policy runs a batch: under the data-parallel choice, or through this rank's pipeline stage."""

    model: torch.nn.Module
    device: torch.device
    choice: Any  # distributed.data_parallel.Choice
    loss: Callable[[torch.Tensor, Any], LossResult]
    plan: Any = None  # distributed.mesh.PipelinePlan, with pipeline stages
    pipeline: Any = None  # distributed.pipeline.Pipeline, with pipeline stages
    rows: Callable[[MicroBatch], torch.Tensor | None] = lambda mb: None  # the algorithm's ``pipeline_rows``
    _kept: list[torch.Tensor | None] = field(default_factory=list, init=False, repr=False)

    def compute(self) -> Any:
        return self.choice.compute(self.device) if self.choice is not None else contextlib.nullcontext()

    def logits(self, mb: MicroBatch, model: torch.nn.Module | None = None) -> torch.Tensor:
        """``model``'s (the policy's) logits of a micro-batch, under the data-parallel choice."""
        with self.compute():
            return model_logits(self.model if model is None else model, mb, self.device)

    def batch_loss(self, mb: MicroBatch, target: Any) -> LossResult:
        """A micro-batch's loss from the policy's logits (its target made first: a reference's forward)."""
        return self.loss(self.logits(mb), target)

    def staged(self, mb: MicroBatch, target: Any) -> tuple[torch.Tensor, Any, dict[str, torch.Tensor]]:
        """A batch's token ids, its target and its other row inputs, in the algorithm's ``pipeline_rows`` order."""
        order, extra = self.rows(mb), row_inputs(mb)
        if order is None:
            return mb.input_ids, target, extra
        target = target[order.to(target.device)] if isinstance(target, torch.Tensor) else target.rows(order)
        return mb.input_ids[order], target, {k: v[order] for k, v in extra.items()}

    def staged_loss(self, logits: torch.Tensor, target: Any) -> torch.Tensor:
        """The pipeline schedule's loss of a microbatch (its metric sums kept for ``staged_sums``)."""
        result = self.loss(logits, target)
        self._kept.append(result.sums)
        return result.loss

    def staged_sums(self) -> list[torch.Tensor | None]:
        """The last schedule run's microbatches' metric sums, less torch's first calls that infer the shapes."""
        kept = self._kept[len(self._kept) - self.plan.microbatches:] if self._kept else []
        self._kept = []
        return kept

    @torch.no_grad()
    def evaluate(self, mb: MicroBatch, target: Any) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """A held-out batch's summed loss (float64, on the host; zero before the last stage) and its metric sums."""
        if self.pipeline is None:
            result = self.batch_loss(mb, target)
            return result.loss.double().cpu(), [result.sums]
        return self.pipeline.evaluate(*self.staged(mb, target), IGNORE_INDEX), self.staged_sums()


@dataclass
class TrainContext:
    """Everything an algorithm reads of the run, filled in as the recipe builds it."""

    cfg: Any
    run: Run
    env: Any = None
    dims: Any = None  # distributed.mesh.ParallelDims
    model: Any = None
    tokenizer: Any = None
    processor: Any = None
    forward: Forward | None = None


def model_logits(model: torch.nn.Module, mb: MicroBatch, device: torch.device) -> torch.Tensor:
    """``model``'s logits for a micro-batch's rows, given what its rows need besides the tokens."""
    inputs = {"input_ids": mb.input_ids}
    if mb.pixel_values is not None:  # image-text rows: one image each, placed at its image tokens
        inputs |= {"attention_mask": mb.attention_mask, "pixel_values": mb.pixel_values}
    elif mb.position_ids is not None:
        # packed rows: position ids that restart keep attention inside each example (no 2-D mask, no KV cache)
        inputs["position_ids"] = mb.position_ids
    elif not bool(mb.attention_mask.all()):  # without padding no mask: attention takes its causal fast path (flash)
        inputs["attention_mask"] = mb.attention_mask
    return model(**{k: v.to(device) for k, v in inputs.items()}, use_cache=False).logits


def row_inputs(mb: MicroBatch) -> dict[str, torch.Tensor]:
    """What every pipeline stage needs of a batch besides the tokens: packed rows' position ids, or the mask."""
    if mb.position_ids is not None:
        return {"position_ids": mb.position_ids}
    return {"attention_mask": mb.attention_mask}
