"""GRPO's pure parts: seeded sampling with a KV cache, group advantages, the clipped loss with k3 KL, reward checks,
prompts too long for the context."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from automodel_ckpt.algorithms.grpo.algorithm import take_prompts
from automodel_ckpt.training.rewards import RewardError, answer_digits, digits_then_eos, exact_answer, score
from automodel_ckpt.training.rollout import ADVANTAGES, IGNORE, advantages, clipped_loss, generate, \
    group_advantages, group_shares, sample_seed, token_log_probs

EOS, PAD = 1, 0


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         eos_token_id=EOS, pad_token_id=PAD, bos_token_id=2)
    return LlamaForCausalLM(config).eval()


PROMPTS = [[2, 5, 6, 7], [2, 9], [2, 10, 11, 12, 13, 14], [2, 3, 4], [2, 20, 21], [2, 8, 8, 8, 8]]


def _seeds(rows: list[int]) -> list[int]:
    return [sample_seed(42, 3, pid, 0) for pid in rows]


def _generate(model, rows: list[int], **kw) -> list[list[int]]:
    return generate(model, [PROMPTS[r] for r in rows], _seeds(rows), max_new_tokens=6, temperature=1.0, eos_id=EOS,
                    pad_id=PAD, **kw)


def test_batched_generation_equals_one_at_a_time(model):
    everything = list(range(len(PROMPTS)))
    batched = _generate(model, everything)
    alone = [_generate(model, [r])[0] for r in everything]
    assert batched == alone
    assert any(len(c) > 1 for c in batched)  # prompts of different lengths: left padding was exercised


def test_each_token_is_the_inverse_cdf_of_the_next_draw_of_the_completions_own_stream(model):
    """The definition the resume guarantee rests on, decoded the slow way (the whole sequence again for each token,
    no cache, no padding, one draw at a time), must give what the batched, cached sampler gives."""
    rows = list(range(len(PROMPTS)))
    batched = _generate(model, rows)
    for r, seed in zip(rows, _seeds(rows)):
        g, seq, slow = torch.Generator().manual_seed(seed), list(PROMPTS[r]), []
        for _ in range(6):
            logits = model(input_ids=torch.tensor([seq])).logits[0, -1].double()
            cdf = torch.softmax(logits, dim=-1).cumsum(dim=-1)
            u = torch.rand(1, generator=g, dtype=torch.float64)
            token = min(int(torch.searchsorted(cdf, u * cdf[-1])), len(cdf) - 1)
            slow.append(token)
            seq.append(token)
            if token == EOS:
                break
        assert batched[r] == slow, r


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_pick_is_the_inverse_cdf_of_the_tempered_float64_softmax(temperature):
    """What ``_pick`` computes in place, spelled out: the same tokens, bit for bit, on wide rows of any scale."""
    from automodel_ckpt.training.rollout import _pick

    torch.manual_seed(0)
    for scale in (0.5, 4.0, 30.0):
        logits = torch.randn(16, 5000) * scale
        u = torch.rand(16, dtype=torch.float64)
        cdf = torch.softmax(logits.double() / temperature, dim=-1).cumsum(dim=-1)
        want = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1)).squeeze(1).clamp_max(4999)
        assert torch.equal(_pick(logits, u, temperature), want)


def test_the_prompt_pass_asks_for_the_last_positions_logits_only(model):
    """A large vocabulary's logits for every prompt position would be gigabytes; only the last one is sampled."""
    seen = []
    handle = model.lm_head.register_forward_hook(lambda _m, _i, out: seen.append(tuple(out.shape)))
    try:
        _generate(model, [2, 0])
    finally:
        handle.remove()
    assert seen[0] == (2, 1, 32), seen  # PROMPTS[2] has 6 tokens: 6 positions' logits without logits_to_keep


def test_a_lora_model_samples_as_its_base_with_the_base_models_keywords(model):
    """PEFT passes keywords through: the cache goes by the base model's own name (``past_key_values`` is deprecated
    in transformers 5 and goes in 5.40) and the prompt pass keeps the last position's logits only. A fresh adapter
    (B = 0) changes nothing, so its completions are the base's."""
    import copy
    import warnings

    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).eval()
    seen = []
    handle = lora.get_base_model().lm_head.register_forward_hook(lambda _m, _i, out: seen.append(out.shape[1]))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert _generate(lora, [0, 1, 2]) == _generate(model, [0, 1, 2])
    finally:
        handle.remove()
    assert not [w for w in caught if "past_key_values" in str(w.message)]
    assert set(seen) == {1}


def test_sampling_does_not_depend_on_how_prompts_are_split_across_ranks(model):
    everything = list(range(len(PROMPTS)))
    whole = _generate(model, everything)
    for ranks in (2, 3):
        per = len(everything) // ranks
        split = [c for r in range(ranks) for c in _generate(model, everything[r * per:(r + 1) * per])]
        assert split == whole
    # the stream is the completion's own: another rollout step or sample index draws another one
    assert sample_seed(42, 3, 0, 0) != sample_seed(42, 4, 0, 0) != sample_seed(42, 3, 0, 1)


def test_greedy_and_eos_stop(model):
    out = generate(model, [PROMPTS[0]], [1], max_new_tokens=5, temperature=0.0, eos_id=None, pad_id=PAD)
    logits = model(input_ids=torch.tensor([PROMPTS[0]])).logits[0, -1]
    assert len(out[0]) == 5 and out[0][0] == int(logits.argmax())
    first = out[0][0]
    stopped = generate(model, [PROMPTS[0]], [1], max_new_tokens=5, temperature=0.0, eos_id=first, pad_id=PAD)
    assert stopped == [[first]]  # the end of sequence is kept, nothing after it


def test_group_advantages_are_normalised_per_prompt():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    adv = group_advantages(rewards, 4)
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std().item()
    assert adv[:4].tolist() == pytest.approx([0.5 / (std + 1e-4), -0.5 / (std + 1e-4)] * 1 + [-0.5 / (std + 1e-4),
                                             0.5 / (std + 1e-4)])
    assert adv[4:].tolist() == [0.0] * 4  # every completion alike: no signal, no division by zero


def test_share_advantages_give_each_rewarded_group_a_weight_of_one():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0,  0.0, 0.0, 0.0, 0.0,  1.0, 0.0, 0.0, 0.0,  2.0, 1.0, 1.0, 0.0])
    adv = group_shares(rewards, 4)
    assert adv.tolist() == [0.5, 0.0, 0.0, 0.5] + [0.0] * 4 + [1.0, 0.0, 0.0, 0.0] + [0.5, 0.25, 0.25, 0.0]
    assert adv.view(4, 4).sum(1).tolist() == [1.0, 0.0, 1.0, 1.0]  # a group with no reward: no signal, no division
    assert ADVANTAGES["share"] is group_shares and ADVANTAGES["normalized"] is group_advantages
    assert advantages("share", rewards, 4, ["exact_answer"]).tolist() == adv.tolist()
    with pytest.raises(RewardError, match=r"^grpo.advantage share: a completion's weighted reward is -1; the reward "
                                          r"functions \(exact_answer, digits\) must give >= 0"):
        advantages("share", torch.tensor([1.0, -1.0]), 2, ["exact_answer", "digits"])
    assert advantages("normalized", torch.tensor([1.0, -1.0]), 2, ["x"]).tolist() == group_advantages(
        torch.tensor([1.0, -1.0]), 2).tolist()


def test_clipped_loss_and_k3_kl_on_a_hand_example():
    logp = torch.tensor([[math.log(0.5), math.log(0.5)]], dtype=torch.float64)
    old = torch.tensor([[math.log(0.25), math.log(0.5)]], dtype=torch.float64)  # ratios 2 and 1
    ref = torch.tensor([[math.log(0.25), math.log(0.25)]], dtype=torch.float64)
    keep = torch.tensor([[True, True]])
    loss, sums = clipped_loss(logp, old, ref, torch.tensor([1.0], dtype=torch.float64), keep, epsilon=0.2, beta=0.1)
    k3 = 0.5 - math.log(0.5) - 1  # exp(d) - d - 1 with d = log(0.25 / 0.5)
    # positive advantage: ratio 2 clipped to 1.2; ratio 1 as is
    assert loss.item() == pytest.approx(-(1.2 + 1.0) + 2 * 0.1 * k3)
    assert sums.tolist() == pytest.approx([2.0, 1.0, 2 * k3])
    # negative advantage: min(r A, clip(r) A) takes the unclipped -2 (pessimistic), nothing counted as clipped
    loss, sums = clipped_loss(logp, old, None, torch.tensor([-1.0], dtype=torch.float64), keep, epsilon=0.2)
    assert loss.item() == pytest.approx(2.0 + 1.0) and sums.tolist() == [2.0, 0.0, 0.0]


def test_token_log_probs_aligns_each_label_with_the_logits_before_it():
    logits = torch.randn(1, 4, 5)
    labels = torch.tensor([[IGNORE, IGNORE, 3, 1]])
    out = token_log_probs(logits, labels)
    lsm = torch.log_softmax(logits, -1)
    assert out[0].tolist() == pytest.approx([0.0, 0.0, lsm[0, 1, 3].item(), lsm[0, 2, 1].item()])


def test_shipped_rewards():
    assert exact_answer(["1+2="] * 3, ["3", " 3", "4"], ["3"] * 3) == [1.0, 1.0, 0.0]
    assert digits_then_eos([""] * 3, ["12", "12", "1a"], [""] * 3, ended=[True, False, True]) == [1.0, 0.0, 0.0]
    assert answer_digits([""] * 4, ["82", "85", "182", ""], ["82"] * 4) == [1.0, 0.5, 0.0, 0.0]


@pytest.mark.parametrize("fn, words", [
    (lambda p, c, a, **_: 1 / 0, "reward function bad failed: ZeroDivisionError"),
    (lambda p, c, a, **_: [1.0], "reward function bad returned 1 rewards for 2 completions"),
    (lambda p, c, a, **_: [1.0, float("nan")], "reward function bad returned nan for completion 1"),
    (lambda p, c, a, **_: ["x", 1.0], "reward function bad returned list, not one number per completion"),
])
def test_bad_reward_functions_are_one_line_naming_the_function(fn, words):
    with pytest.raises(RewardError) as info:
        score("bad", fn, ["p", "p"], ["1", "2"], ["1", "2"], [True, True])
    assert str(info.value).startswith(words) and "\n" not in str(info.value)


def test_prompts_longer_than_the_context_are_counted_and_skipped():
    order = torch.tensor([3, 0, 2, 1, 4])
    lengths = [5, 9, 5, 12, 5]
    ids, position, skipped = take_prompts(order, 0, lengths, 3, limit=8)
    assert (ids, position, skipped) == ([0, 2, 4], 5, 2)
    assert take_prompts(order, 5, lengths, 1, limit=8) == ([], 5, 0)  # the order's end: the caller rolls over


def _algorithm_with_prompts(prompt_ids: list[list[int]], seq_length: int, max_new_tokens: int):
    """A GRPO algorithm with only what taking prompts reads (no model, no process group)."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from automodel_ckpt.algorithms.grpo.algorithm import GRPO
    from automodel_ckpt.algorithms.grpo.state import GRPOCounters

    algorithm = GRPO.__new__(GRPO)
    algorithm.ctx = SimpleNamespace(cfg=OmegaConf.create({"seed": 1, "data": {"seq_length": seq_length,
                                                                                  "shuffle": False}}),
                                       env=SimpleNamespace(is_main=True))
    algorithm.grpo_cfg = OmegaConf.create({"max_new_tokens": max_new_tokens})
    algorithm.grpo, algorithm._orders, algorithm._warned = GRPOCounters(), {}, False
    algorithm._prompts, algorithm._prompt_ids = ["p"] * len(prompt_ids), prompt_ids
    return algorithm


def test_too_long_prompts_warn_once_and_are_counted():
    algorithm = _algorithm_with_prompts([[1] * 3, [1] * 9, [1] * 3, [1] * 9, [1] * 3], seq_length=8,
                                        max_new_tokens=4)
    with pytest.warns(UserWarning, match=r"prompts longer than .* \(4 tokens\) are skipped") as seen:
        assert algorithm._next_prompts(2) == [0, 2]
        assert algorithm._next_prompts(2) == [4, 0]  # the next epoch begins
    assert len(seen) == 1
    counters = algorithm.grpo
    assert counters.skipped_prompts == 2 and (counters.prompt_epoch, counters.prompt_position) == (1, 1)


def test_pipeline_stages_and_bad_advantage_keys_are_refused_in_one_line():
    from omegaconf import OmegaConf

    from automodel_ckpt.algorithms.grpo.config import GRPOConfig
    from automodel_ckpt.errors import ConfigError
    from automodel_ckpt.algorithms.grpo.config import check_section

    section = OmegaConf.structured(GRPOConfig)
    with pytest.raises(ConfigError, match="^distributed.pp_size: GRPO samples completions with the whole model"):
        check_section(section, 16, pp_size=2)
    with pytest.raises(ConfigError, match="grpo.num_generations: 4 must be >= 1 and divide"):
        check_section(section, 18, pp_size=1)
    section.advantage = "rank"
    with pytest.raises(ConfigError, match="^grpo.advantage: 'rank' is not one of normalized, share$"):
        check_section(section, 16, pp_size=1)
    section.advantage, section.reward_weights = "share", [1.0, -0.5]
    with pytest.raises(ConfigError, match="^grpo.reward_weights: share advantages need weights >= 0"):
        check_section(section, 16, pp_size=1)
    section.advantage = "normalized"
    check_section(section, 16, pp_size=1)  # negative weights are fine there


def test_rollout_batches_that_teach_nothing_are_warned_about_once_in_a_row():
    """Every advantage 0 (each group's completions rewarded alike: a model that never finds the reward) for
    ``FLAT_BATCHES_WARNING`` rollout batches in a row: one warning saying what to do; a batch with signal resets."""
    import warnings

    from automodel_ckpt.algorithms.grpo import algorithm as grpo

    algorithm = _algorithm_with_prompts([[1]], seq_length=8, max_new_tokens=4)
    algorithm._flat = 0
    flat = torch.tensor([0.0] * 7 + [-2.8e-13], dtype=torch.float64)  # equal rewards, their mean rounded
    signal = torch.tensor([0.0] * 7 + [1.0], dtype=torch.float64)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for advantage in [flat] * (grpo.FLAT_BATCHES_WARNING - 1) + [signal] + [flat] * (grpo.FLAT_BATCHES_WARNING - 1):
            algorithm._check_signal(advantage)
        assert not seen
        for _ in range(3):
            algorithm._check_signal(flat)
    assert len(seen) == 1
    assert str(seen[0].message).startswith(f"grpo: in the last {grpo.FLAT_BATCHES_WARNING} rollout batches every "
                                           "group's completions were rewarded alike (every advantage 0)")
    assert "--checkpoint.restore_from" in str(seen[0].message)


def test_transformers_generate_with_the_pick_as_a_logits_processor_gives_the_same_tokens_until_the_model_has_defaults(
        model):
    """Why the sampling loop is the product's own (docs/rl.md): ``generate`` with the per-row inverse-CDF pick as its
    last logits processor gives the same tokens, but it fills every option left unset from the model's own
    ``generation_config`` (a checkpoint's generation_config.json), and such a default (here a repetition penalty)
    changes the scores the pick reads."""
    from copy import deepcopy

    from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

    from automodel_ckpt.training.rollout import _pick

    rows = [0, 1, 2, 3, 4, 5]
    prompts, seeds = [PROMPTS[r] for r in rows], _seeds(rows)
    width, steps = max(len(p) for p in prompts), 6
    uniforms = torch.stack([torch.rand(steps, generator=torch.Generator().manual_seed(s), dtype=torch.float64)
                            for s in seeds])

    class Pick(LogitsProcessor):
        def __call__(self, input_ids, scores):
            tokens = _pick(scores, uniforms[:, input_ids.shape[1] - width], 1.0)
            return torch.full_like(scores, -math.inf).scatter_(1, tokens.unsqueeze(1), 0.0)

    def through_generate(m) -> list[list[int]]:
        ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
        out = m.generate(input_ids=ids, attention_mask=(ids != PAD).long(), logits_processor=LogitsProcessorList(
            [Pick()]), generation_config=GenerationConfig(max_new_tokens=steps, do_sample=False, eos_token_id=EOS,
                                                          pad_token_id=PAD))
        return [row[:row.index(EOS) + 1] if EOS in row else row for row in out[:, width:].tolist()]

    ours = _generate(model, rows)
    assert through_generate(model) == ours
    with_defaults = deepcopy(model)
    with_defaults.generation_config.repetition_penalty = 3.0  # as a checkpoint's generation_config.json may set
    assert through_generate(with_defaults) != ours
