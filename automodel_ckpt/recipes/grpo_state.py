"""GRPO's checkpointed state: its counters and statistics, its prompt position, and the rollout batch in use."""

from __future__ import annotations

import math
from typing import Any

import torch

from automodel_ckpt.errors import CheckpointError

_COUNTS = ("grpo_step", "ppo_optimization_step", "consumed_prompts", "generated_completions", "generated_tokens",
           "skipped_prompts", "prompt_epoch", "prompt_position")
_SUMS = ("reward_sum", "reward_square_sum")


class GRPOCounters:
    """Counters (checkpointed as ``grpo``): rollout batches made (``grpo_step``), optimizer steps
    (``ppo_optimization_step``), prompts consumed and skipped, completions and tokens generated, the rewards'
    running sums, and the prompt data position (epoch, position in that epoch's order)."""

    def __init__(self) -> None:
        for key in _COUNTS:
            setattr(self, key, 0)
        for key in _SUMS:
            setattr(self, key, 0.0)

    def state_dict(self) -> dict[str, Any]:
        return dict(vars(self))

    def load_state_dict(self, state: Any) -> None:
        """A checkpoint's counters (untrusted): each a count or a finite number, else one line."""
        if not isinstance(state, dict):
            raise CheckpointError(f"the GRPO counters are a {type(state).__name__}, not a mapping")
        for key in _COUNTS:
            value = state.get(key, 0)
            if not (type(value) is int and 0 <= value < 1 << 62):
                raise CheckpointError(f"the GRPO counters: '{key}' is not a count")
            setattr(self, key, value)
        for key in _SUMS:
            value = state.get(key, 0.0)
            if not (isinstance(value, float) and math.isfinite(value)):
                raise CheckpointError(f"the GRPO counters: '{key}' is not a finite number")
            setattr(self, key, value)

    def shown(self) -> dict[str, Any]:
        """What ``ckpt-train inspect`` lists (the checkpoint's metadata holds it)."""
        mean = self.reward_sum / self.generated_completions if self.generated_completions else None
        return {"grpo_step": self.grpo_step, "ppo_optimization_step": self.ppo_optimization_step,
                "consumed_prompts": self.consumed_prompts, "generated_completions": self.generated_completions,
                "generated_tokens": self.generated_tokens, "skipped_prompts": self.skipped_prompts,
                "reward_mean_so_far": mean}


_TENSORS = {"prompt_ids": torch.int64, "sample_index": torch.int64, "input_ids": torch.int64,
            "prompt_length": torch.int64, "length": torch.int64, "old_log_probs": torch.float64,
            "ref_log_probs": torch.float64, "advantages": torch.float64, "rewards": torch.float64}


class RolloutBatch:
    """The rollout batch in use (checkpointed as ``rollout``): every completion of the global batch, the same on
    every rank (a resume at another world size takes its share of it). Per row: the prompt's id and the sample's
    index, the token ids (prompt then completion, right-padded), the prompt's and the whole row's length, the
    per-token log-probs when it was sampled and the reference's, the advantage and the rewards (one column per
    reward function); and ``step`` (the ``grpo_step`` that made it) and ``passes`` (optimizer passes taken
    over it). Empty (``rows`` 0) before the first rollout."""

    def __init__(self) -> None:
        self.step = 0
        self.passes = 0
        self.tensors: dict[str, torch.Tensor] = {}

    @property
    def rows(self) -> int:
        return len(self.tensors["input_ids"]) if self.tensors else 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "passes": self.passes, **{k: v.clone() for k, v in self.tensors.items()}}

    def load_state_dict(self, state: Any) -> None:
        """A checkpoint's rollout batch (untrusted): the tensors it names, of their dtypes and row counts."""
        if not isinstance(state, dict):
            raise CheckpointError(f"the GRPO rollout batch is a {type(state).__name__}, not a mapping")
        for key in ("step", "passes"):
            if not (type(state.get(key)) is int and 0 <= state[key] < 1 << 62):
                raise CheckpointError(f"the GRPO rollout batch: '{key}' is not a count")
        tensors = {k: v for k, v in state.items() if k in _TENSORS}
        if tensors and set(tensors) != set(_TENSORS):
            raise CheckpointError(f"the GRPO rollout batch lacks {sorted(set(_TENSORS) - set(tensors))}")
        rows = {len(v) for v in tensors.values() if isinstance(v, torch.Tensor)}
        for key, value in tensors.items():
            if not isinstance(value, torch.Tensor) or value.dtype != _TENSORS[key] or len(rows) != 1:
                raise CheckpointError(f"the GRPO rollout batch: '{key}' is not a {_TENSORS[key]} tensor with one "
                                      "row per completion")
        self.step, self.passes, self.tensors = state["step"], state["passes"], tensors
