"""Pipeline stages cut from a causal LM with whole-model names, trained and evaluated by torch's pipelining schedules.

Every parameter keeps its whole-model name, so no checkpoint or export knows of stages (docs/parallelism.md).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from automodel_ckpt.distributed.mesh import PipelinePlan, ParallelDims, resolve_pipeline
from automodel_ckpt.distributed.tensor_parallel import causal_lm, family_name, ties_embeddings
from automodel_ckpt.errors import ConfigError


def _base(model: nn.Module) -> nn.Module:
    model = causal_lm(model)
    return getattr(model, getattr(model, "base_model_prefix", "model"), model)


def tied_embeddings(model: nn.Module) -> bool:
    """Whether the head's weight is the input embedding's, on the model before the cut."""
    return ties_embeddings(causal_lm(model))


def decoder_layer_list(model: nn.Module) -> nn.ModuleList:
    """The family's decoder layers (``model.layers``); a ``ConfigError`` for a family laid out otherwise."""
    base = _base(model)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not all(hasattr(base, n) for n in ("embed_tokens", "norm")) \
            or not hasattr(causal_lm(model), "lm_head"):
        raise ConfigError(f"distributed.pp_size: the '{family_name(model)}' model has no decoder-layer list beside "
                          "its embedding and final norm (model.layers, embed_tokens, norm, lm_head) to cut into "
                          "stages; use pp_size 1")
    return layers


def check_pipeline_model(model: nn.Module, section: Any, dims_sizes: Any, local_batch_size: int) -> PipelinePlan:
    """The pipeline plan checked against the model's decoder layers."""
    layers = decoder_layer_list(model)
    return resolve_pipeline(section, dims_sizes, local_batch_size, num_layers=len(layers))


def rank_layers(plan: PipelinePlan, num_layers: int, pp_rank: int, pp_size: int) -> list[range]:
    """The decoder layers of each stage pipeline rank ``pp_rank`` holds (one range, or one per interleaved stage)."""
    every = plan.stage_layers(num_layers, plan.stages(pp_size))
    return [every[stage] for stage in plan.rank_stages(pp_rank, pp_size)]


def layer_span(layers: range) -> str:
    """``0-2``, or ``3`` for one layer."""
    return f"{layers.start}-{layers.stop - 1}" if len(layers) > 1 else f"{layers.start}"


def describe_layers(chunks: list[range]) -> str:
    """``decoder layers 0-2``, ``decoder layer 3``, ``decoder layers 0-1 and 4-5``."""
    spans = [layer_span(r) for r in chunks]
    several = len(chunks) > 1 or len(chunks[0]) > 1
    listed = ", ".join(spans[:-1]) + " and " + spans[-1] if len(spans) > 1 else spans[0]
    return f"decoder layer{'s' if several else ''} {listed}"


def cut_stage(model: nn.Module, plan: PipelinePlan, pp_rank: int, pp_size: int) -> list[range]:
    """Keep on ``model`` (meta device, before sharding) only pipeline rank ``pp_rank``'s stages' modules; returns
    each stage's decoder layers. With tied embeddings the last rank keeps the embedding module too (never called)."""
    from transformers.distributed.pipeline_parallel import PipelineIdentityLayer

    layers = decoder_layer_list(model)
    chunks = rank_layers(plan, len(layers), pp_rank, pp_size)
    mine = {index for chunk in chunks for index in chunk}
    tied = tied_embeddings(model)
    for index in range(len(layers)):
        if index not in mine:
            layers[index] = PipelineIdentityLayer()
    base = _base(model)
    if pp_rank > 0 and not (tied and pp_rank == pp_size - 1):
        base.embed_tokens = PipelineIdentityLayer()
    if pp_rank < pp_size - 1:
        base.norm = PipelineIdentityLayer()
        causal_lm(model).lm_head = PipelineIdentityLayer()
    return chunks


class TiedEmbedding:
    """The input embedding's weight shared with the head across the first and the last stage: both copies start
    equal and ``sum_gradients`` all-reduces each FSDP2 shard with its peer's, so they stay equal. Collective."""

    def __init__(self, model: nn.Module, dims: ParallelDims) -> None:
        import torch.distributed as dist

        self.model, self.held = model, dims.pp_rank in (0, dims.pp_size - 1)
        #: the last stage leaves the tied weight out of its gradient norm: the first stage counts it
        self.counted_here = dims.pp_rank == 0
        if dims.pp_size == 2:
            self.group = dims.pp_group
        else:  # a group of the first and last rank of every pipeline (every rank makes every group)
            lines = dims.mesh.mesh.reshape(dims.pp_size, -1).T.tolist()
            self.group, _ = dist.new_subgroups_by_enumeration([[line[0], line[-1]] for line in lines])

    @property
    def weight(self) -> nn.Parameter | None:
        """The tied weight on this stage (FSDP2's sharded parameter), or None on a middle stage."""
        return causal_lm(self.model).get_input_embeddings().weight if self.held else None

    @torch.no_grad()
    def sum_gradients(self) -> None:
        """Collective over the first and last stage: each copy's gradient becomes the sum of both."""
        weight = self.weight
        if weight is None or not weight.requires_grad or weight.grad is None:
            return
        grad = weight.grad
        torch.distributed.all_reduce(grad.to_local() if hasattr(grad, "to_local") else grad, group=self.group)

    def uncounted(self) -> list[nn.Parameter]:
        """The parameters whose gradient another stage counts in the gradient norm (the last stage's copy)."""
        return [] if self.counted_here or self.weight is None else [self.weight]


class _OneStageAtATime:
    """Which of a rank's stages the next forward runs (``interleaved_1f1b``): the other stages' layers (and the
    norm and head but on the last) are the identity meanwhile, swapped by a pre-hook after FSDP2's own."""

    def __init__(self, model: nn.Module, chunks: list[range], holds_head: bool) -> None:
        from transformers.distributed.pipeline_parallel import PipelineIdentityLayer

        self.identity, self.chunks, self.holds_head = PipelineIdentityLayer(), chunks, holds_head
        self.layers, self.base, self.causal_lm = decoder_layer_list(model), _base(model), causal_lm(model)
        self.running: int | None = None  # the index of the running stage among the rank's (None: not a stage's call)
        self.swapped: list[tuple[nn.Module, str, nn.Module]] = []
        model.register_forward_pre_hook(self._enter)
        model.register_forward_hook(self._leave, always_call=True)

    def _swap(self, parent: nn.Module, name: str) -> None:
        self.swapped.append((parent, name, getattr(parent, name)))
        setattr(parent, name, self.identity)

    def _enter(self, module: nn.Module, args: Any) -> None:
        if self.running is None:
            return
        for k, chunk in enumerate(self.chunks):
            if k != self.running:
                for index in chunk:
                    self._swap(self.layers, str(index))
        if self.holds_head and self.running != len(self.chunks) - 1:
            self._swap(self.base, "norm")
            self._swap(self.causal_lm, "lm_head")

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        while self.swapped:
            parent, name, original = self.swapped.pop()
            setattr(parent, name, original)


class StageModule(nn.Module):
    """What a pipeline stage runs: token ids or hidden states to hidden states (logits on the last stage)."""

    def __init__(self, model: nn.Module, first: bool, interleave: _OneStageAtATime | None = None,
                 slot: int = 0) -> None:
        super().__init__()
        self.model, self.first = model, first
        self.interleave, self.slot = interleave, slot

    def forward(self, inputs: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        key = "input_ids" if self.first else "inputs_embeds"
        if self.interleave is not None:
            self.interleave.running = self.slot
        try:
            return self.model(**{key: inputs}, **kwargs, use_cache=False).logits
        finally:
            if self.interleave is not None:
                self.interleave.running = None


class _StageLoss:
    """The schedule's loss: each microbatch's summed token loss times ``scale``. A target that is no tensor (with
    ``rows(index)``) is held here, and torch splits its row numbers."""

    def __init__(self, token_loss_sum: Callable[[torch.Tensor, Any], torch.Tensor]) -> None:
        self.token_loss_sum, self.scale, self.target = token_loss_sum, 1.0, None

    def split(self, target: Any) -> torch.Tensor:
        """What the schedule splits into microbatches: a tensor target, or another's row numbers."""
        self.target = None if isinstance(target, torch.Tensor) else target
        return target if self.target is None else torch.arange(len(target))

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        target = labels if self.target is None else self.target.rows(labels)
        return self.token_loss_sum(logits, target) * self.scale


class Pipeline:
    """This rank's stage under torch's schedule; ``step``, ``evaluate``: the token loss sum (last stage), else 0."""

    def __init__(self, model: nn.Module, dims: ParallelDims, plan: PipelinePlan, device: torch.device,
                 token_loss_sum: Callable[[torch.Tensor, Any], torch.Tensor], rows: int,
                 tied: bool = False) -> None:
        from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                                  ScheduleInterleaved1F1B)

        # A stage's output (hidden states cut by the head's slice, a view) goes to the next stage, never changed in
        # place: FSDP2's warning about views does not apply.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")

        self.dims, self.device, self.rows = dims, device, rows
        self.tied = TiedEmbedding(model, dims) if tied else None
        self.first, self.last = dims.pp_rank == 0, dims.pp_rank == dims.pp_size - 1
        self.loss = _StageLoss(token_loss_sum)
        # the loss is already weighted by the global batch's tokens: the gradients are summed, not averaged
        options = {"n_microbatches": plan.microbatches, "loss_fn": self.loss, "scale_grads": False}
        chunks = rank_layers(plan, len(decoder_layer_list(model)), dims.pp_rank, dims.pp_size)
        interleave = _OneStageAtATime(model, chunks, self.last) if len(chunks) > 1 else None
        stages = [PipelineStage(StageModule(model, index == 0, interleave, slot), index, plan.stages(dims.pp_size),
                                device, group=dims.pp_group)
                  for slot, index in enumerate(plan.rank_stages(dims.pp_rank, dims.pp_size))]
        if plan.schedule == "interleaved_1f1b":  # a schedule of several stages per rank takes their list
            self.schedule = ScheduleInterleaved1F1B(stages, **options)
        else:
            self.schedule = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[plan.schedule](stages[0], **options)

    def _run(self, run: Callable[..., Any], input_ids: torch.Tensor, labels: Any,
             extra: dict[str, torch.Tensor], scale: float) -> torch.Tensor:
        self.loss.scale = scale
        args = (input_ids.to(self.device),) if self.first else ()
        kwargs = {k: v.to(self.device) for k, v in extra.items()}
        losses: list[torch.Tensor] = []  # the schedule's, one per microbatch, on the last stage
        target = self.loss.split(labels).to(self.device) if self.last else None
        run(*args, target=target, losses=losses if self.last else None, return_outputs=False, **kwargs)
        if not losses:
            return torch.zeros((), dtype=torch.float64)
        return torch.stack([loss.detach().double().cpu() for loss in losses]).sum() / scale

    def step(self, input_ids: torch.Tensor, labels: Any, extra: dict[str, torch.Tensor], scale: float) -> torch.Tensor:
        """Forward and backward of one local batch through every stage (gradients accumulate)."""
        return self._run(self.schedule.step, input_ids, labels, extra, scale)

    def share_tied_gradients(self) -> list[nn.Parameter]:
        """After a batch's last ``step``: the tied gradient summed; returns the parameters the norm leaves out."""
        if self.tied is None:
            return []
        self.tied.sum_gradients()
        return self.tied.uncounted()

    @torch.no_grad()
    def forward_rows(self, input_ids: torch.Tensor, labels: torch.Tensor,
                     extra: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """Forward only (the schedule's ``eval``), when the loss function gives one value per row (a reference's
        log-probs): every row's value in row order on the last stage, None on the others."""
        args = (input_ids.to(self.device),) if self.first else ()
        kwargs = {k: v.to(self.device) for k, v in extra.items()}
        rows: list[torch.Tensor] = []
        self.schedule.eval(*args, target=self.loss.split(labels).to(self.device) if self.last else None,
                           losses=rows if self.last else None, return_outputs=False, **kwargs)
        return torch.cat([r.detach() for r in rows]) if rows else None

    @torch.no_grad()
    def evaluate(self, input_ids: torch.Tensor, labels: Any, extra: dict[str, torch.Tensor],
                 ignore_index: int) -> torch.Tensor:
        """Forward only; a short batch is filled with copies of its first row labelled ``ignore_index``."""
        short = self.rows - len(input_ids)
        if short > 0:
            def fill(t: torch.Tensor, value: int | None = None) -> torch.Tensor:
                rows = t[:1].expand(short, *t.shape[1:]).clone()
                return torch.cat([t, rows.fill_(value) if value is not None else rows])

            input_ids, labels = fill(input_ids), fill(labels, ignore_index)
            extra = {k: fill(v) for k, v in extra.items()}
        return self._run(self.schedule.eval, input_ids, labels, extra, 1.0)
