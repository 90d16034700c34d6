"""Pipeline stages cut from a causal LM with whole-model names, trained and evaluated by torch's pipelining schedules.

Each stage is the whole model with the modules of the other stages replaced by transformers' parameterless
``PipelineIdentityLayer`` at the same place: its decoder layers, the embedding on the first stage only, the final
norm and the head on the last only. Every parameter a stage holds keeps its whole-model name, so its
``state_dict`` is a subset of the whole model's and the checkpoint, the base read and the export need no stage
knowledge. The model's own ``forward`` runs each stage: the first from the token ids, the others from the hidden
states received (``inputs_embeds``); the position embeddings and the causal mask are computed on every stage as the
model computes them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from automodel_ckpt.distributed.mesh import PipelinePlan, ParallelDims, resolve_pipeline
from automodel_ckpt.errors import ConfigError


def _base(model: nn.Module) -> nn.Module:
    return getattr(model, getattr(model, "base_model_prefix", "model"), model)


def family_name(model: nn.Module) -> str:
    return str(getattr(getattr(model, "config", None), "model_type", type(model).__name__))


def decoder_layer_list(model: nn.Module) -> nn.ModuleList:
    """The family's decoder layers (``model.layers``, beside ``embed_tokens`` and ``norm``); a one-line
    ``ConfigError`` for a family laid out otherwise."""
    base = _base(model)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not all(hasattr(base, n) for n in ("embed_tokens", "norm")) \
            or not hasattr(model, "lm_head"):
        raise ConfigError(f"distributed.pp_size: the '{family_name(model)}' model has no decoder-layer list beside "
                          "its embedding and final norm (model.layers, embed_tokens, norm, lm_head) to cut into "
                          "stages; use pp_size 1")
    return layers


def check_pipeline_model(model: nn.Module, section: Any, dims_sizes: Any, local_batch_size: int) -> PipelinePlan:
    """The pipeline plan checked against the model: its layers, and the head not tied to the embedding."""
    layers = decoder_layer_list(model)
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        raise ConfigError(f"distributed.pp_size: the '{family_name(model)}' model ties its head to its input "
                          "embedding (tie_word_embeddings), which sit on the first and the last stage; pipeline "
                          "parallelism with tied embeddings is not supported yet; use pp_size 1")
    return resolve_pipeline(section, dims_sizes, local_batch_size, num_layers=len(layers))


def cut_stage(model: nn.Module, plan: PipelinePlan, stage: int, stages: int) -> range:
    """Keep on ``model`` (on the meta device, before sharding) only the modules of ``stage``; returns its layers."""
    from transformers.distributed.pipeline_parallel import PipelineIdentityLayer

    layers = decoder_layer_list(model)
    mine = plan.stage_layers(len(layers), stages)[stage]
    for index in range(len(layers)):
        if index not in mine:
            layers[index] = PipelineIdentityLayer()
    base = _base(model)
    if stage > 0:
        base.embed_tokens = PipelineIdentityLayer()
    if stage < stages - 1:
        base.norm = PipelineIdentityLayer()
        model.lm_head = PipelineIdentityLayer()
    return mine


class StageModule(nn.Module):
    """What a pipeline stage runs: the stage's model from token ids (first stage) or hidden states (the others) to
    hidden states, or to logits on the last stage. ``kwargs``: the attention mask or position ids of the rows."""

    def __init__(self, model: nn.Module, first: bool) -> None:
        super().__init__()
        self.model, self.first = model, first

    def forward(self, inputs: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        key = "input_ids" if self.first else "inputs_embeds"
        return self.model(**{key: inputs}, **kwargs, use_cache=False).logits


class _StageLoss:
    """The schedule's loss: each microbatch's summed token loss times ``scale`` (what is backpropagated)."""

    def __init__(self, token_loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        self.token_loss_sum, self.scale = token_loss_sum, 1.0

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.token_loss_sum(logits, labels) * self.scale


class Pipeline:
    """This rank's stage of the model under torch's schedule (``plan.schedule``) over the pipeline group.

    ``token_loss_sum(logits, labels)``: a microbatch's summed token loss (the recipe's); ``rows``: the rows of a
    local batch (``plan.microbatches`` microbatches of one shape). ``step`` and ``evaluate``
    return the summed token loss of the rows on the last stage, zero on the others.
    """

    def __init__(self, model: nn.Module, dims: ParallelDims, plan: PipelinePlan, device: torch.device,
                 token_loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], rows: int) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        # A stage's output (hidden states cut by the head's slice, a view) goes to the next stage, never changed in
        # place: FSDP2's warning about views does not apply.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")

        self.dims, self.device, self.rows = dims, device, rows
        self.first, self.last = dims.pp_rank == 0, dims.pp_rank == dims.pp_size - 1
        self.stage = PipelineStage(StageModule(model, self.first), dims.pp_rank, dims.pp_size, device,
                                   group=dims.pp_group)
        self.loss = _StageLoss(token_loss_sum)
        kind = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[plan.schedule]
        # the loss is already weighted by the global batch's tokens: the gradients are summed, not averaged
        self.schedule = kind(self.stage, n_microbatches=plan.microbatches, loss_fn=self.loss, scale_grads=False)

    def _run(self, run: Callable[..., Any], input_ids: torch.Tensor, labels: torch.Tensor,
             extra: dict[str, torch.Tensor], scale: float) -> torch.Tensor:
        self.loss.scale = scale
        args = (input_ids.to(self.device),) if self.first else ()
        kwargs = {k: v.to(self.device) for k, v in extra.items()}
        losses: list[torch.Tensor] = []  # the schedule's, one per microbatch, on the last stage
        run(*args, target=labels.to(self.device) if self.last else None, losses=losses if self.last else None,
            return_outputs=False, **kwargs)
        if not losses:
            return torch.zeros((), dtype=torch.float64)
        return torch.stack([loss.detach().double().cpu() for loss in losses]).sum() / scale

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor, extra: dict[str, torch.Tensor],
             scale: float) -> torch.Tensor:
        """Forward and backward of one local batch through every stage (gradients accumulate)."""
        return self._run(self.schedule.step, input_ids, labels, extra, scale)

    @torch.no_grad()
    def evaluate(self, input_ids: torch.Tensor, labels: torch.Tensor, extra: dict[str, torch.Tensor],
                 ignore_index: int) -> torch.Tensor:
        """Forward only (the schedule's ``eval``). A batch of fewer rows than the training batches (the last
        validation batch) is filled with copies of its first row whose labels are all ``ignore_index``: the stages
        exchange microbatches of one shape."""
        short = self.rows - len(input_ids)
        if short > 0:
            def fill(t: torch.Tensor, value: int | None = None) -> torch.Tensor:
                rows = t[:1].expand(short, *t.shape[1:]).clone()
                return torch.cat([t, rows.fill_(value) if value is not None else rows])

            input_ids, labels = fill(input_ids), fill(labels, ignore_index)
            extra = {k: fill(v) for k, v in extra.items()}
        return self._run(self.schedule.eval, input_ids, labels, extra, 1.0)
