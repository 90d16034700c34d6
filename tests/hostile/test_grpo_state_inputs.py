"""A GRPO checkpoint's rollout batch (``rollout.pt``) whose fields are out of what a rollout makes: one line each.

A genuine rollout batch is made by the recipe's own code (``GRPO._rows_tensors``, the group advantages, the per-token
log-probs of random logits) for 2 prompts x 4 completions; each case tampers one field and loads it into a
``RolloutBatch`` that knows this run's model and recipe (``RolloutExpected``), as a resume does. The guarantees:
token ids inside the vocabulary, lengths inside the row and ``data.seq_length``, every number finite and in range
(advantages at most sqrt(group), log-probs from ``LOG_PROB_FLOOR`` to 0, the log-probs as sampled NaN only all
together for a batch that had its pass), the shapes as written and every field's rows those of the global batch,
grouped as the recipe samples them. A refusal is one ``CheckpointError`` line naming the field (the loader prefixes
the file), and nothing of the tampered batch is kept. The run over a tampered checkpoint file end to end:
``tests/integration/test_grpo.py``.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any, Callable

import pytest
import torch
from omegaconf import OmegaConf

from automodel_ckpt.errors import CheckpointError
from automodel_ckpt.algorithms.grpo.algorithm import GRPO
from automodel_ckpt.algorithms.grpo.state import LOG_PROB_FLOOR, RolloutBatch, RolloutExpected
from automodel_ckpt.training.rollout import advantages, token_log_probs

PAD, BOS, EOS = 0, 1, 2
VOCAB, SEQ_LENGTH, GROUP, ROWS = 49, 16, 4, 8
PROMPTS = [[BOS, 7, 10, 41], [BOS, 5, 41, 6, 44], [BOS, 9, 9, 41]]  # token ids, by prompt id
EXPECTED = RolloutExpected(rows=ROWS, group=GROUP, reward_functions=2, vocab=VOCAB, seq_length=SEQ_LENGTH,
                           prompts=PROMPTS)


def genuine(one_pass: bool = False) -> dict[str, Any]:
    """A rollout batch as the recipe makes it: prompts 2 and 0, 4 completions each, two reward functions."""
    algorithm = GRPO.__new__(GRPO)
    algorithm.ctx = SimpleNamespace(
        tokenizer=SimpleNamespace(pad_token_id=PAD, eos_token_id=EOS), dims=SimpleNamespace(dp_size=1, dp_rank=0),
        cfg=OmegaConf.create({"step_scheduler": {"local_batch_size": ROWS}}))
    algorithm._prompt_ids = PROMPTS
    algorithm.rollout = RolloutBatch()
    gen = torch.Generator().manual_seed(0)
    rows = [(p, i) for p in (2, 0) for i in range(GROUP)]
    completions = [torch.randint(3, VOCAB, (1 + r % 4,), generator=gen).tolist() + [EOS] for r in range(ROWS)]
    t = algorithm._rows_tensors(rows, completions)
    t["rewards"] = torch.rand(ROWS, 2, generator=gen, dtype=torch.float64)
    t["advantages"] = advantages("normalized", t["rewards"].sum(dim=1), GROUP, ["a", "b"])
    algorithm.rollout.tensors = t
    (mb,) = algorithm._micro_batches()
    logits = 3 * torch.randn(ROWS, t["input_ids"].shape[1], VOCAB, generator=gen)
    t["old_log_probs"] = torch.full_like(t["old_log_probs"], math.nan) if one_pass else \
        token_log_probs(logits, mb.labels).double()
    t["ref_log_probs"] = token_log_probs(logits + torch.randn(logits.shape, generator=gen), mb.labels).double()
    return {"step": 3, "passes": 1, **t}


def load(state: dict[str, Any], expected: RolloutExpected | None = EXPECTED) -> RolloutBatch:
    batch = RolloutBatch()
    batch.expected = expected
    batch.load_state_dict(state)
    return batch


def refused(state: dict[str, Any], field: str, expected: RolloutExpected | None = EXPECTED) -> str:
    """The batch is refused in one line naming ``field``; nothing of it is kept."""
    batch = RolloutBatch()
    batch.expected = expected
    with pytest.raises(CheckpointError) as caught:
        batch.load_state_dict(state)
    line = str(caught.value)
    assert line.startswith(f"the GRPO rollout batch: '{field}' ") and "\n" not in line, line
    assert batch.tensors == {} and batch.passes == 0
    return line


def test_a_genuine_batch_loads_and_trains_as_saved():
    state = genuine()
    batch = load(state)
    assert batch.rows == ROWS and batch.passes == 1
    assert all(torch.equal(batch.tensors[k], state[k]) for k in batch.tensors)
    load(genuine(one_pass=True))  # the log-probs as sampled not recorded (NaN) at one pass per batch
    load(genuine(), expected=None)  # before the model is known: what needs no model is checked
    load({"step": 0, "passes": 0})  # before the first rollout: empty


@pytest.mark.parametrize("field, value", [
    ("weight_version", -1), ("weight_version", 2**62), ("weight_version", 1.5), ("weight_version", "3"),
    ("weight_version", True), ("weight_hash", "XYZ"), ("weight_hash", "a" * 65), ("weight_hash", 7),
    ("weight_hash", "ab\ncd")])
def test_the_weights_that_sampled_it_are_a_count_and_a_hash(field, value):
    """``weight_version`` and ``weight_hash`` (an engine's rollout batch, docs/rl.md): a count and a hexadecimal
    hash, else one line; a batch saved before them loads with version 0 and no hash."""
    batch = load(genuine() | {"weight_version": 4, "weight_hash": "0123abcd" * 2})
    assert (batch.weight_version, batch.weight_hash) == (4, "0123abcd" * 2)
    assert (load(genuine()).weight_version, load(genuine()).weight_hash) == (0, "")
    refused(genuine() | {field: value}, field)


def test_a_batch_sampled_ahead_has_taken_no_pass():
    """``next_rollout`` (``grpo.max_staleness`` 1) is a rollout batch, checked as one, never trained on yet."""
    batch = RolloutBatch()
    batch.ahead = True
    batch.expected = EXPECTED
    batch.load_state_dict(genuine() | {"passes": 0})
    batch = RolloutBatch()
    batch.ahead = True
    with pytest.raises(CheckpointError, match="'passes' is not 0 in the batch sampled ahead"):
        batch.load_state_dict(genuine())


def test_batches_sampled_ahead_fill_the_first_slots_in_order_and_move_up_as_each_is_taken():
    """``grpo.max_staleness`` K: a checkpoint's ``next_rollout``, ``next_rollout_2``, ... fill the first slots in the
    order they were sampled, else one line before training; each step takes the first, the rest move up."""
    def slots(*steps: int) -> GRPO:
        algorithm = GRPO.__new__(GRPO)
        algorithm.rollout, algorithm._slots = RolloutBatch(), []
        for step in steps:
            algorithm._slots.append(RolloutBatch(ahead=True))
            if step:
                algorithm._slots[-1].load_state_dict(genuine() | {"passes": 0, "step": step})
        return algorithm

    for bad in ((0, 6), (6, 5), (5, 5, 0)):
        with pytest.raises(CheckpointError, match=r"not the first slots in sampling order \(rollout batches"):
            slots(*bad)._check_slots()
    held = slots(5, 6, 0)
    held._check_slots()
    assert held._take_ahead() and held.rollout.step == 5 and held.rollout.passes == 0
    assert [(s.step, s.rows) for s in held._slots] == [(6, ROWS), (0, 0), (0, 0)]
    assert held._take_ahead() and held.rollout.step == 6 and not held._take_ahead()
    assert not slots()._take_ahead()  # grpo.max_staleness 0: nothing is held ahead
    # an engine lost as a step asks for its batch: the counters and every batch put back as the last step left them
    from automodel_ckpt.algorithms.grpo.state import GRPOCounters

    held = slots(5, 6, 0)
    held.grpo = GRPOCounters()
    held.grpo.grpo_step, held.grpo.prompt_position = 6, 12
    kept = held._kept()
    assert held._take_ahead()
    held.grpo.grpo_step, held.grpo.prompt_position = 7, 14  # the next batch's prompts taken, its request lost
    held._put_back(kept)
    assert (held.grpo.grpo_step, held.grpo.prompt_position, held.rollout.rows) == (6, 12, 0)
    assert [(s.step, s.rows) for s in held._slots] == [(5, ROWS), (6, ROWS), (0, 0)]


def _set(key: str, at: Any, value: Any) -> Callable[[dict[str, Any]], None]:
    def tamper(state: dict[str, Any]) -> None:
        state[key][at] = value
    return tamper


# --- token ids -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [10**6, -1, VOCAB, 2**62, -(2**63)])
@pytest.mark.parametrize("at", [(0, 1), (5, -1)])  # a prompt's token, a completion's or its padding
def test_token_ids_outside_the_vocabulary(value, at):
    state = genuine()
    state["input_ids"][at] = value
    assert str(value) in refused(state, "input_ids")


def test_negative_token_ids_are_refused_before_the_model_is_known():
    state = genuine()
    state["input_ids"][3, 2] = -5
    refused(state, "input_ids", expected=None)


@pytest.mark.parametrize("value", [10**6, len(PROMPTS), -1, 2**62])
def test_prompt_ids_that_are_no_prompt_of_the_dataset(value):
    state = genuine()
    state["prompt_ids"][:GROUP] = value  # the whole group: it differs from no other row of it
    refused(state, "prompt_ids")


def test_a_row_that_does_not_start_with_its_prompt():
    state = genuine()
    state["prompt_ids"][GROUP:] = 1  # a prompt of 5 tokens where prompt 0's 4 are
    refused(state, "prompt_length")
    state = genuine()
    state["input_ids"][0, 2] = 3  # the prompt's second token changed
    refused(state, "input_ids")


@pytest.mark.parametrize("tamper, field", [
    (_set("prompt_ids", 1, 0), "prompt_ids"),  # one completion of another prompt inside a group
    (_set("sample_index", 1, 0), "sample_index"),
    (_set("sample_index", 0, -1), "sample_index"),
    (_set("sample_index", 3, 10**6), "sample_index"),
])
def test_rows_not_grouped_as_the_recipe_samples_them(tamper, field):
    state = genuine()
    tamper(state)
    refused(state, field)


# --- lengths ---------------------------------------------------------------------------------------------------------

def _wide(width: int) -> Callable[[dict[str, Any]], None]:
    """Every per-token field widened to ``width`` (consistent with each other), padding and zeros."""
    def tamper(state: dict[str, Any]) -> None:
        for key in ("input_ids", "old_log_probs", "ref_log_probs"):
            old = state[key]
            state[key] = torch.zeros(ROWS, width, dtype=old.dtype)
            state[key][:, :old.shape[1]] = old
    return tamper


def _stride_zero(state: dict[str, Any]) -> None:
    """Rows of 2^30 tokens stored as one value each (a view whose shape the file's bytes do not hold)."""
    for key in ("input_ids", "old_log_probs", "ref_log_probs"):
        state[key] = torch.zeros(ROWS, 1, dtype=state[key].dtype).expand(ROWS, 2**30)


@pytest.mark.parametrize("tamper", [_wide(2**18), _wide(SEQ_LENGTH + 1), _stride_zero])
def test_rows_wider_than_the_sequence_length(tamper):
    state = genuine()
    tamper(state)
    assert "data.seq_length" in refused(state, "input_ids")


def test_a_view_wider_than_its_bytes_is_refused_before_the_model_is_known():
    state = genuine()
    _stride_zero(state)
    refused(state, "input_ids", expected=None)


@pytest.mark.parametrize("key, value", [
    ("length", 10**6), ("length", 2**62), ("length", SEQ_LENGTH + 1), ("length", -1), ("length", 0),
    ("prompt_length", -1), ("prompt_length", 10**6), ("prompt_length", 2**62), ("prompt_length", -(2**62)),
])
def test_lengths_outside_their_row(key, value):
    state = genuine()
    state[key][2] = value
    refused(state, key)


def test_a_row_without_a_completion():
    state = genuine()
    state["length"][4] = state["prompt_length"][4]
    refused(state, "prompt_length")


def test_a_prompt_length_that_is_not_its_prompts():
    state = genuine()
    state["prompt_length"][0] -= 1
    refused(state, "prompt_length")


# --- numbers ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 1e308, -1e308, 1e6, math.sqrt(GROUP) * 1.01])
def test_advantages_not_finite_or_out_of_bounds(value):
    state = genuine()
    state["advantages"][5] = value
    refused(state, "advantages")


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_advantages_not_finite_before_the_model_is_known(value):
    state = genuine()
    state["advantages"][0] = value
    refused(state, "advantages", expected=None)


@pytest.mark.parametrize("key", ["old_log_probs", "ref_log_probs"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 1e308, -1e308, -1e30, LOG_PROB_FLOOR * 2, 0.5])
def test_log_probs_not_finite_or_out_of_range(key, value):
    state = genuine()
    state[key][6, 5] = value
    refused(state, key)


def test_log_probs_as_sampled_nan_only_all_together_for_a_batch_that_had_its_pass():
    state = genuine(one_pass=True)
    state["old_log_probs"][0, 0] = 0.0  # NaN but in one place
    refused(state, "old_log_probs")
    state = genuine(one_pass=True)
    state["passes"] = 0  # not passed over yet: its ratio would be NaN
    refused(state, "old_log_probs")
    state = genuine(one_pass=True)
    state["ref_log_probs"][1, 3] = math.nan  # the reference's are always recorded
    refused(state, "ref_log_probs")


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_rewards_not_finite(value):
    state = genuine()
    state["rewards"][7, 1] = value
    refused(state, "rewards")


# --- shapes ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("key, value, field", [
    ("advantages", torch.tensor(1.0, dtype=torch.float64), "advantages"),  # 0-d
    ("advantages", torch.zeros(ROWS, 1, dtype=torch.float64), "advantages"),
    ("input_ids", torch.ones(ROWS, dtype=torch.int64), "input_ids"),  # 1-D token ids
    ("input_ids", torch.ones(ROWS, 4, 2, dtype=torch.int64), "input_ids"),
    ("length", torch.tensor(5), "length"),
    ("rewards", torch.zeros(ROWS, dtype=torch.float64), "rewards"),
    ("rewards", torch.zeros(ROWS, 3, dtype=torch.float64), "rewards"),  # 3 columns for 2 reward functions
    ("rewards", torch.zeros(ROWS, 1, dtype=torch.float64), "rewards"),
    ("old_log_probs", torch.zeros(ROWS, 3, dtype=torch.float64), "old_log_probs"),  # not the token ids' width
    ("ref_log_probs", torch.zeros(ROWS, dtype=torch.float64), "ref_log_probs"),
    ("advantages", torch.zeros(ROWS, dtype=torch.float32), "advantages"),  # another dtype
    ("input_ids", [[1, 2]] * ROWS, "input_ids"),  # not a tensor
])
def test_shapes_not_as_written(key, value, field):
    state = genuine()
    state[key] = value
    refused(state, field)


@pytest.mark.parametrize("key", ["prompt_ids", "sample_index", "prompt_length", "length", "advantages", "rewards",
                                 "old_log_probs", "ref_log_probs"])
@pytest.mark.parametrize("rows", [ROWS - 1, ROWS + 1, 0])
def test_a_field_with_other_rows_than_the_token_ids(key, rows):
    state = genuine()
    value = state[key]
    state[key] = value[:rows] if rows <= ROWS else torch.cat([value, value[:1]])
    refused(state, key)


@pytest.mark.parametrize("rows", [GROUP, 2 * ROWS, 0])
def test_a_batch_of_other_rows_than_the_global_batch(rows):
    state = genuine()
    for key in ("prompt_ids", "sample_index", "input_ids", "prompt_length", "length", "old_log_probs",
                "ref_log_probs", "advantages", "rewards"):
        state[key] = state[key][:rows] if rows <= ROWS else torch.cat([state[key], state[key]])
    assert "step_scheduler.global_batch_size" in refused(state, "input_ids")


def test_the_model_and_recipe_are_known_before_a_resume_loads():
    """``GRPO.build`` (the end of setup, before the restore) gives the rollout batch what it is checked against."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from automodel_ckpt.algorithms.grpo.algorithm import vocab_rows

    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    assert vocab_rows(model) == VOCAB
    algorithm = GRPO.__new__(GRPO)
    algorithm.ctx = SimpleNamespace(model=model, cfg=OmegaConf.create(
        {"step_scheduler": {"global_batch_size": ROWS}, "data": {"seq_length": SEQ_LENGTH}}))
    algorithm.grpo_cfg = OmegaConf.create({"beta": 0.0, "num_generations": GROUP, "engine": "transformers"})
    algorithm._peft, algorithm._rewards, algorithm._prompt_ids = False, [("a", None), ("b", None)], PROMPTS
    algorithm.rollout, algorithm._slots = RolloutBatch(), [RolloutBatch(ahead=True), RolloutBatch(ahead=True)]
    algorithm.build()
    assert algorithm.rollout.expected == EXPECTED
    assert all(slot.expected == EXPECTED for slot in algorithm._slots)  # grpo.max_staleness 2: its batches ahead


def test_the_prompt_position_is_counts_and_an_earlier_map_style_position_leaves_the_counters():
    """The ``dataloader`` state of a GRPO run is its prompt position (``PromptLoader``): each a count, else one line;
    a checkpoint written before held a map-style loader's position there: the counters' (``grpo``) stands."""
    from automodel_ckpt.algorithms.grpo.state import GRPOCounters, PromptLoader

    counters = GRPOCounters()
    loader = PromptLoader(lambda: (0, []), counters, ROWS, 1, 4)
    counters.prompt_epoch, counters.prompt_position = 2, 5
    loader.load_state_dict({"epoch": 0, "position": 16, "global_batch_size": ROWS, "seed": 1})  # an earlier one
    assert loader.state_dict() == {"prompt_epoch": 2, "prompt_position": 5} and loader.epoch == 2
    loader.load_state_dict({"prompt_epoch": 3, "prompt_position": 1})
    assert (counters.prompt_epoch, counters.prompt_position) == (3, 1)
    for state in ({"prompt_epoch": -1, "prompt_position": 0}, {"prompt_epoch": 0, "prompt_position": 2.5},
                  {"prompt_epoch": True}, [1, 2]):
        with pytest.raises(CheckpointError) as refused:
            loader.load_state_dict(state)
        assert str(refused.value).startswith("the GRPO prompt position") and "\n" not in str(refused.value)
    assert (counters.prompt_epoch, counters.prompt_position) == (3, 1)
