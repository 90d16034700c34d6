"""GRPO's checkpointed state: its counters and statistics, its prompt position, and the rollout batch in use."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from automodel_ckpt.data import GlobalPosition
from automodel_ckpt.errors import CheckpointError
from automodel_ckpt.ondisk import is_count

_COUNTS = ("grpo_step", "ppo_optimization_step", "consumed_prompts", "generated_completions", "generated_tokens",
           "skipped_prompts", "prompt_epoch", "prompt_position")
_SUMS = ("reward_sum", "reward_square_sum")


class GRPOCounters:
    """Counters (checkpointed as ``grpo``), the rewards' running sums and the prompts' epoch and position."""

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
            if not is_count(value):
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
        return {key: getattr(self, key) for key in _COUNTS if not key.startswith("prompt_")} | {
            "reward_mean_so_far": mean}


class PromptLoader(GlobalPosition):
    """GRPO's loader (checkpointed as ``dataloader``): its state is the prompts' epoch and position (kept in the
    counters), each step's micro-batches ``make()``'s share of the rollout batch in use. Saved per rank, the same
    on every rank."""

    checkpoint_scope = "rank"

    def __init__(self, make: Callable[[], tuple[int, list[Any]]], counters: GRPOCounters, global_batch_size: int,
                 grad_accum: int, steps_per_epoch: int) -> None:
        self.make, self.counters = make, counters
        self.global_batch_size, self.grad_accum, self.steps_per_epoch = global_batch_size, grad_accum, steps_per_epoch
        self.last_sample_ids: list[int] = []

    @property
    def epoch(self) -> int:
        return self.counters.prompt_epoch

    def next_batch(self) -> tuple[int, list[Any]]:
        return self.make()

    def state_dict(self) -> dict[str, Any]:
        return {"prompt_epoch": self.counters.prompt_epoch, "prompt_position": self.counters.prompt_position}

    def load_state_dict(self, state: Any) -> None:
        """A checkpoint's position (untrusted): each a count, else one line; without one the counters' stands."""
        if not isinstance(state, dict):
            raise CheckpointError(f"the GRPO prompt position is a {type(state).__name__}, not a mapping")
        position = {k: state[k] for k in ("prompt_epoch", "prompt_position") if k in state}
        for key, value in position.items():
            if not is_count(value):
                raise CheckpointError(f"the GRPO prompt position: '{key}' is not a count")
        for key, value in position.items():
            setattr(self.counters, key, value)

    def steps_left(self, num_epochs: int) -> int:
        """Optimizer steps left until ``num_epochs`` epochs of prompts are taken (this epoch counted whole)."""
        return max(0, (num_epochs - self.counters.prompt_epoch) * self.steps_per_epoch)

    def begin_stage(self) -> str | None:
        return None


_TENSORS = {"prompt_ids": torch.int64, "sample_index": torch.int64, "input_ids": torch.int64,
            "prompt_length": torch.int64, "length": torch.int64, "old_log_probs": torch.float64,
            "ref_log_probs": torch.float64, "advantages": torch.float64, "rewards": torch.float64}
#: Each tensor's dimensions: ``[rows, width]`` (ids, log-probs), ``[rows, reward functions]``, or ``[rows]``.
_DIMS = {"prompt_ids": 1, "sample_index": 1, "input_ids": 2, "prompt_length": 1, "length": 1, "old_log_probs": 2,
         "ref_log_probs": 2, "advantages": 1, "rewards": 2}
#: The lowest log-prob a rollout batch may hold: far below a real log-softmax, far above where ``exp`` overflows.
LOG_PROB_FLOOR = -1e4


@dataclass(frozen=True)
class RolloutExpected:
    """What this run's rollout batch is, from the recipe and the model: a checkpoint's is checked against it."""

    rows: int  # step_scheduler.global_batch_size: one row per completion
    group: int  # grpo.num_generations: consecutive rows are one prompt's completions, sample index 0, 1, ...
    reward_functions: int  # len(grpo.reward_funcs): the rewards' columns
    vocab: int  # token ids are below it (the model's embedding rows)
    seq_length: int  # data.seq_length: the widest row
    prompts: Sequence[Sequence[int]]  # each prompt's token ids, by prompt id (what a row starts with)


class RolloutBatch:
    """The rollout batch in use (checkpointed as ``rollout``): every completion of the global batch, the same on
    every rank; per row its ids, lengths, log-probs, advantage and rewards (``_TENSORS``). ``step``: the
    ``grpo_step`` that made it; ``passes``: optimizer passes over it; ``weight_version`` and ``weight_hash``: the
    weights that sampled it ("" in process). ``expected`` is what a checkpoint's batch is checked against."""

    def __init__(self, ahead: bool = False) -> None:
        self.step = 0
        self.passes = 0
        self.weight_version = 0
        self.weight_hash = ""
        self.ahead = ahead  # sampled ahead (``next_rollout``, ``_2``, ...): never trained on, so no pass taken
        self.engine_hash = ""  # the engine's hash of those weights, as it answered (not saved: equal to weight_hash)
        self.tensors: dict[str, torch.Tensor] = {}
        self.expected: RolloutExpected | None = None

    @property
    def rows(self) -> int:
        return len(self.tensors["input_ids"]) if self.tensors else 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "passes": self.passes, "weight_version": self.weight_version,
                "weight_hash": self.weight_hash, **{k: v.clone() for k, v in self.tensors.items()}}

    def load_state_dict(self, state: Any) -> None:
        """A checkpoint's (untrusted) rollout batch, checked by ``check_rollout``."""
        if not isinstance(state, dict):
            raise CheckpointError(f"the GRPO rollout batch is a {type(state).__name__}, not a mapping")
        for key in ("step", "passes"):
            if not is_count(state.get(key)):
                raise CheckpointError(f"the GRPO rollout batch: '{key}' is not a count")
        if self.ahead and state["passes"]:
            raise CheckpointError("the GRPO rollout batch: 'passes' is not 0 in the batch sampled ahead (next_rollout)")
        version, digest = state.get("weight_version", 0), state.get("weight_hash", "")  # absent before engines
        if not is_count(version):
            raise CheckpointError("the GRPO rollout batch: 'weight_version' is not a count")
        if not (isinstance(digest, str) and len(digest) <= 64 and all(c in "0123456789abcdef" for c in digest)):
            raise CheckpointError("the GRPO rollout batch: 'weight_hash' is not a hexadecimal hash")
        tensors = {k: v for k, v in state.items() if k in _TENSORS}
        if tensors and set(tensors) != set(_TENSORS):
            raise CheckpointError(f"the GRPO rollout batch lacks {sorted(set(_TENSORS) - set(tensors))}")
        if tensors:
            check_rollout(tensors, state["passes"], self.expected)
        self.step, self.passes, self.tensors = state["step"], state["passes"], tensors
        self.weight_version, self.weight_hash = version, digest


def _bad(key: str, what: str) -> CheckpointError:
    return CheckpointError(f"the GRPO rollout batch: '{key}' {what}")


def _first(values: torch.Tensor, wrong: torch.Tensor) -> tuple[int, Any]:
    """The first row where ``wrong`` holds, and the value there."""
    at = tuple(wrong.nonzero()[0].tolist())
    return at[0], values[at].item()


def _refuse(key: str, values: torch.Tensor, wrong: torch.Tensor, verb: str, tail: str) -> None:
    """``_bad``: "KEY VERB VALUE in row ROW TAIL" at the first place where ``wrong`` holds, if any."""
    if bool(wrong.any()):
        row, value = _first(values, wrong)
        raise _bad(key, f"{verb} {value} in row {row}{tail}")


def check_rollout(t: dict[str, torch.Tensor], passes: int, expected: RolloutExpected | None) -> None:
    """A checkpoint's rollout tensors are what a rollout makes, else one line naming the field: shapes first
    (nothing allocated from them), then token ids, lengths, prompts, and every number finite and in range."""
    for key, value in t.items():
        if not isinstance(value, torch.Tensor) or value.dtype != _TENSORS[key]:
            raise _bad(key, f"is not a {_TENSORS[key]} tensor")
        if value.dim() != _DIMS[key]:
            raise _bad(key, f"has {value.dim()} dimensions, not {_DIMS[key]}")
    ids = t["input_ids"]
    rows, width = ids.shape
    if expected is not None:
        if rows != expected.rows:
            raise _bad("input_ids", f"has {rows} rows, not step_scheduler.global_batch_size ({expected.rows})")
        if width > expected.seq_length:
            raise _bad("input_ids", f"is {width} tokens wide, over data.seq_length ({expected.seq_length})")
    for key, value in t.items():
        if value.numel() * value.element_size() > value.untyped_storage().nbytes():  # a view: stride 0, overlaps
            raise _bad(key, f"has the shape {list(value.shape)} over fewer stored values")
        if len(value) != rows:
            raise _bad(key, f"has {len(value)} rows, 'input_ids' {rows}")
    for key in ("old_log_probs", "ref_log_probs"):
        if t[key].shape != ids.shape:
            raise _bad(key, f"is {list(t[key].shape)}, not the token ids' {[rows, width]}")
    if expected is not None and t["rewards"].shape[1] != expected.reward_functions:
        raise _bad("rewards", f"has {t['rewards'].shape[1]} columns for {expected.reward_functions} reward "
                              "functions (grpo.reward_funcs)")
    if rows == 0:
        return
    _check_rows(t, width, expected)
    _check_numbers(t, passes, expected)


def _check_rows(t: dict[str, torch.Tensor], width: int, expected: RolloutExpected | None) -> None:
    """Token ids inside the vocabulary; ``0 <= prompt_length < length <= width``; each group one prompt's
    completions, each row starting with that prompt's tokens."""
    ids, first, length = t["input_ids"], t["prompt_length"], t["length"]
    vocab = expected.vocab if expected is not None else None
    wrong = (ids < 0) | (ids >= vocab) if vocab is not None else ids < 0
    inside = f"outside the model's vocabulary (0 to {vocab - 1})" if vocab is not None else "below 0"
    _refuse("input_ids", ids, wrong, "holds token id", f", {inside}")
    _refuse("prompt_length", first, first < 0, "is", ", below 0")
    _refuse("length", length, (length < 1) | (length > width), "is", f", not from 1 to the row's width ({width})")
    if bool((first >= length).any()):
        row, value = _first(first, first >= length)
        raise _bad("prompt_length", f"is {value} in row {row}, not below its 'length' ({int(length[row])}): a row "
                                    "holds a completion of at least one token")
    pid, index = t["prompt_ids"], t["sample_index"]
    prompts = len(expected.prompts) if expected is not None else None
    wrong = (pid < 0) | (pid >= prompts) if prompts is not None else pid < 0
    _refuse("prompt_ids", pid, wrong, "is", ", not a prompt of the dataset"
            + (f" (0 to {prompts - 1})" if prompts is not None else ""))
    if expected is None:
        if bool((index < 0).any()):
            raise _bad("sample_index", f"is {_first(index, index < 0)[1]}, not a sample index")
        return
    group = expected.group
    if not torch.equal(index, torch.arange(len(index)) % group):
        raise _bad("sample_index", f"is not 0 to {group - 1} in each group of grpo.num_generations ({group}) rows")
    groups = pid.reshape(-1, group)
    if bool((groups != groups[:, :1]).any()):
        raise _bad("prompt_ids", f"differ within a group of grpo.num_generations ({group}) rows")
    for row, (p, n) in enumerate(zip(pid.tolist(), first.tolist())):
        prompt = expected.prompts[p]
        if n != len(prompt):
            raise _bad("prompt_length", f"is {n} in row {row}; its prompt ({p}) has {len(prompt)} tokens")
        if ids[row, :n].tolist() != list(prompt):
            raise _bad("input_ids", f"row {row} does not start with its prompt's ({p}) tokens")


def _check_numbers(t: dict[str, torch.Tensor], passes: int, expected: RolloutExpected | None) -> None:
    """Rewards finite; advantages at most sqrt(group) in size (a normalized group reward is (n - 1) / sqrt(n) at
    most); log-probs in [``LOG_PROB_FLOOR``, 0], or those as sampled all NaN for a batch that had its one pass."""
    rewards = t["rewards"]
    _refuse("rewards", rewards, ~torch.isfinite(rewards), "holds", ", not a finite number")
    group = expected.group if expected is not None else len(rewards)
    bound = math.sqrt(group)
    advantages = t["advantages"]
    _refuse("advantages", advantages, ~(advantages.abs() <= bound), "holds",  # ~: NaN too
            f": an advantage is finite, at most {bound:g} in size (the square root of a group of {group})")
    old = t["old_log_probs"]
    unrecorded = torch.isnan(old)
    if bool(unrecorded.any()) and not (bool(unrecorded.all()) and passes >= 1):
        raise _bad("old_log_probs", "holds NaN: only a batch that had its one pass (passes >= 1) holds NaN, and then "
                                    "in every place (not recorded)")
    for key in ("ref_log_probs",) + (() if bool(unrecorded.any()) else ("old_log_probs",)):
        values = t[key]
        _refuse(key, values, ~((values >= LOG_PROB_FLOOR) & (values <= 0)), "holds",  # ~: NaN too
                f": a log-prob is finite, from {LOG_PROB_FLOOR:g} to 0")
