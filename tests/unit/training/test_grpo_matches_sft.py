"""GRPO trains on what SFT trains on: the same token ids and label positions for a prompt and its answer, and, with
every completion's advantage 1 at its first pass (ratio 1, beta 0), the gradient of the supervised loss."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from transformers import LlamaConfig, LlamaForCausalLM

from automodel_ckpt.data.encode import DataSpec, Encoder
from automodel_ckpt.algorithms.sft.algorithm import Supervised
from automodel_ckpt.algorithms.grpo.algorithm import GRPO
from automodel_ckpt.algorithms.grpo.state import GRPOCounters, RolloutBatch
from automodel_ckpt.training.rollout import token_log_probs

PAD, BOS, EOS = 0, 1, 2
#: "37+45=" -> "82" in a character vocabulary (ids >= 3), and two more problems of other lengths.
PROMPTS = [[7, 10, 41, 8, 9, 44], [5, 41, 6, 44], [9, 9, 41, 9, 9, 44]]
ANSWERS = [[12, 6], [7], [5, 13, 12]]


class _Tokenizer:
    """What ``Encoder`` and ``GRPO._rows_tensors`` read of a tokenizer: ids already split per character."""

    bos_token_id, eos_token_id, pad_token_id = BOS, EOS, PAD

    def __call__(self, texts, add_special_tokens=False, verbose=False):
        return {"input_ids": [list(t) for t in texts]}


def _grpo(local_batch_size: int, num_iterations: int = 2) -> GRPO:
    algorithm = GRPO.__new__(GRPO)
    algorithm.ctx = SimpleNamespace(
        tokenizer=_Tokenizer(), dims=SimpleNamespace(dp_size=1, dp_rank=0), env=SimpleNamespace(device="cpu"),
        cfg=OmegaConf.create({"step_scheduler": {"local_batch_size": local_batch_size}}))
    algorithm.grpo_cfg = OmegaConf.create({"epsilon": 0.2, "epsilon_high": None, "beta": 0.0,
                                           "num_iterations": num_iterations})
    algorithm._prompt_ids = [[BOS] + p for p in PROMPTS]  # what GRPO.build_data makes: bos, then the prompt
    algorithm.rollout = RolloutBatch()
    return algorithm


def _sft_rows() -> tuple[list[list[int]], list[list[int]]]:
    """The supervised recipe's rows of the same problems (prompt/completion records)."""
    return Encoder(_Tokenizer(), DataSpec(seq_length=16), "prompt_completion")._prompt_completion(PROMPTS, ANSWERS)


def test_a_completion_is_trained_on_the_tokens_and_labels_of_the_supervised_row():
    algorithm = _grpo(local_batch_size=8)
    rows = [(p, 0) for p in range(len(PROMPTS))]
    algorithm.rollout.tensors = algorithm._rows_tensors(rows, [a + [EOS] for a in ANSWERS])
    (mb,) = algorithm._micro_batches()
    for i, (ids, labels) in enumerate(zip(*_sft_rows())):
        n = len(ids)
        assert mb.input_ids[i, :n].tolist() == ids and mb.labels[i, :n].tolist() == labels  # eos in the labels
        assert mb.attention_mask[i].tolist() == [1] * n + [0] * (mb.input_ids.shape[1] - n)
        assert (mb.labels[i, n:] == -100).all()


@pytest.mark.parametrize("num_iterations", [2, 1])
def test_advantage_one_at_the_first_pass_has_the_supervised_loss_gradient(num_iterations):
    """With 2 passes the ratio's denominator is the log-probs as sampled (recorded by a forward of their own); with
    one pass it is the pass's own log-probs, detached: what is recorded is not read (garbage here), and
    ``_log_probs`` runs no forward."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=49, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                         bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD))
    algorithm = _grpo(local_batch_size=2, num_iterations=num_iterations)  # two micro-batches: padding differs
    rows = [(p, 0) for p in range(len(PROMPTS))]
    t = algorithm._rows_tensors(rows, [a + [EOS] for a in ANSWERS])
    t["advantages"] = torch.ones(len(rows), dtype=torch.float64)
    algorithm.rollout.tensors = t
    batches = algorithm._micro_batches()
    if num_iterations == 1:
        algorithm.ctx.model = None  # a forward would fail
        old, ref = algorithm._log_probs()
        assert old.isnan().all() and not ref.any()  # not recorded
        t["old_log_probs"].fill_(-3.0)  # not read: exp(logp + 3) would be no ratio of 1
    else:
        with torch.no_grad():  # the log-probs as sampled: the same weights (what GRPO._log_probs records)
            for mb in batches:
                t["old_log_probs"][mb.sample_ids] = token_log_probs(
                    model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits, mb.labels).double()

    def gradient(loss_of) -> tuple[torch.Tensor, list]:
        model.zero_grad()
        results = []
        for mb in batches:
            results.append(loss_of(model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits, mb))
            results[-1].loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()]), [r.sums for r in results]

    grpo, sums = gradient(lambda logits, mb: algorithm.compute_loss(logits, algorithm.loss_target(mb)))
    sft, _ = gradient(lambda logits, mb: Supervised.compute_loss(algorithm, logits, mb.labels))
    assert torch.allclose(grpo.float(), sft, rtol=1e-4, atol=1e-6)
    assert sum(algorithm.loss_count(mb) for mb in batches) == sum(len(a) + 1 for a in ANSWERS)  # the same tokens
    assert [s[0].item() for s in sums] == [len(ANSWERS[0]) + len(ANSWERS[1]) + 2, len(ANSWERS[2]) + 1]
    assert pytest.approx(sum(s[1].item() for s in sums)) == 0.0  # nothing clipped at ratio 1


def test_a_batch_made_for_one_pass_is_not_passed_over_again_by_a_resume_with_more_passes():
    """A checkpoint of a one-pass run (its rollout's log-probs as sampled not recorded) resumed with
    ``num_iterations`` 2: the batch had its pass, and a second one would have no ratio, so a new batch is sampled.
    A batch whose log-probs were recorded gets its second pass."""
    algorithm = _grpo(local_batch_size=8, num_iterations=2)
    algorithm.grpo = GRPOCounters()
    rows = [(p, 0) for p in range(len(PROMPTS))]
    t = algorithm._rows_tensors(rows, [a + [EOS] for a in ANSWERS])
    t["old_log_probs"].fill_(float("nan"))
    algorithm.rollout.tensors, algorithm.rollout.passes = t, 1
    made = []
    algorithm._make_rollout = lambda: made.append(True)
    algorithm._next_rollout()
    assert made == [True]
    t["old_log_probs"].zero_()
    algorithm._next_rollout()
    assert made == [True]  # the same batch, its second pass
