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
    """Every ``every_steps`` steps, the model's weights gathered whole on rank 0 (collective: every rank calls
    ``run``), loaded into a fresh copy of the model built from its config, and scored there by the harness
    (``automodel_ckpt.evaluation``'s ``evaluate``); the scores reach every rank. The training model, its RNG streams
    and its data are untouched, so a run with evaluation trains exactly as one without.
    """

    def __init__(self, section: Any, *, is_main: bool, pp_size: int, peft: bool) -> None:
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
        if pp_size > 1 or peft:
            raise ConfigError("evaluation.every_steps: evaluation during training needs a whole model without LoRA "
                              "(distributed.pp_size 1, no peft:); evaluate the checkpoints with ckpt-train eval")
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
        from transformers import AutoModelForCausalLM

        from automodel_ckpt.evaluation.harness import EvalSettings, evaluate, scores

        with rng_untouched():  # the harness seeds the generators: the training stream is left as it was
            copy = AutoModelForCausalLM.from_config(model.config)
            copy.load_state_dict(state, strict=True)
            copy.to(next(model.parameters()).device).eval()
            settings = EvalSettings(self.tasks, limit=self.limit, batch_size=self.batch_size,
                                    include_path=self.include_path)
            results = evaluate(copy, tokenizer, settings)
        return {metric_name(task, metric): value for task, values in scores(results).items()
                for metric, value in values.items()}
