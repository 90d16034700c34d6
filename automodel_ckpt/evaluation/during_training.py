"""Benchmark tasks during training (the ``evaluation:`` section): the live weights scored by lm-evaluation-harness."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from automodel_ckpt.errors import ConfigError
from automodel_ckpt.training.rng import rng_untouched

PREFIX = "eval"  # a score's name: eval/<task>/<metric> (validation.jsonl, the trackers, a checkpoint's val_metrics)


def metric_name(task: str, metric: str) -> str:
    return f"{PREFIX}/{task}/{metric}"


class InTrainingEval:
    """Every ``every_steps`` steps: the weights gathered whole on rank 0 (collective), loaded into a fresh copy of the
    model (a LoRA model's adapter merged into it), scored there by the harness, the scores sent to every rank. The
    training model, its RNG streams and its data are untouched. Pipeline stages are refused: no rank holds the model."""

    def __init__(self, section: Any, *, is_main: bool, pp_size: int, peft: bool = False) -> None:
        self.every = section.every_steps
        self.tasks = tuple(str(t) for t in section.tasks or ())
        self.limit, self.batch_size, self.is_main = section.limit, int(section.batch_size), is_main
        include = section.get("include_path")
        self.include_path = os.path.abspath(str(include)) if include is not None else None
        if self.every is None:
            return
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ConfigError(f"evaluation.every_steps: expected a positive integer, got {self.every!r}")
        if not self.tasks:
            raise ConfigError("evaluation.tasks: name at least one task (e.g. [addition]) with evaluation.every_steps")
        if pp_size > 1:
            raise ConfigError("evaluation.every_steps: evaluation during training needs the whole model on one rank, "
                              "and each pipeline stage holds only its layers (distributed.pp_size > 1); evaluate the "
                              "checkpoints with ckpt-train eval")
        if is_main:
            from automodel_ckpt.evaluation.harness import task_manager

            task_manager(self.tasks, self.include_path)  # an unknown task: one line now, not at the first evaluation

    def due(self, step: int) -> bool:
        return self.every is not None and step % self.every == 0

    def run(self, model: nn.Module, tokenizer: Any) -> dict[str, float]:
        """``{eval/<task>/<metric>: value}`` of the model's current weights, on every rank. Collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        import torch.distributed as dist

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(model, options=options)  # whole on rank 0 (every rank takes part)
        found: list[Any] = [None]
        if self.is_main:
            found[0] = self._score(model, state, tokenizer)
        del state
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(found, src=0)
        return found[0]

    def _score(self, model: nn.Module, state: dict[str, torch.Tensor], tokenizer: Any) -> dict[str, float]:
        from automodel_ckpt.evaluation.harness import EvalSettings, evaluate, scores

        with rng_untouched():  # the harness seeds the generators (and a LoRA copy draws its init): left as they were
            copy = scoring_copy(model, state)
            copy.to(next(model.parameters()).device).eval()
            settings = EvalSettings(self.tasks, limit=self.limit, batch_size=self.batch_size,
                                    include_path=self.include_path)
            results = evaluate(copy, tokenizer, settings)
        return {metric_name(task, metric): value for task, values in scores(results).items()
                for metric, value in values.items()}


def scoring_copy(model: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    """A plain transformers model holding ``state`` (``model``'s whole state dict): built from ``model``'s config;
    for a PEFT model, the same adapters on a fresh base, loaded, then merged into it (``merge_and_unload``)."""
    import copy as copying

    from transformers import AutoModelForCausalLM

    peft_config = getattr(model, "peft_config", None)
    if not peft_config:
        built = AutoModelForCausalLM.from_config(model.config)
        built.load_state_dict(state, strict=True)
        return built
    from peft import get_peft_model

    built = AutoModelForCausalLM.from_config(model.get_base_model().config)
    built = get_peft_model(built, copying.deepcopy(peft_config["default"]))
    built.load_state_dict(state, strict=True)
    return built.merge_and_unload()
