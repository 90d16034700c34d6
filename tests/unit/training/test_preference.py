"""Preference losses against hand-computed values (TRL's definitions), per-row log-probs, the metric sums, the
``dpo:`` refusals, and (opt-in, where TRL is installed) TRL's own DPOTrainer loss on the same log-probs."""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from automodel_ckpt.algorithms.dpo.config import DPOConfig
from automodel_ckpt.data.tokenize import IGNORE_INDEX
from automodel_ckpt.errors import ConfigError
from automodel_ckpt.algorithms.dpo.config import check_dpo_section
from automodel_ckpt.algorithms.dpo.losses import PreferenceLoss, response_log_probs

# One pair: policy log-probs -3 (chosen, 2 tokens) and -5 (rejected, 4 tokens); reference -4 and -4.
CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED = -3.0, -5.0, -4.0, -4.0
TOKENS_CHOSEN, TOKENS_REJECTED = 2.0, 4.0


def _one(loss: str, **kw) -> tuple[float, float, float]:
    t = lambda v: torch.tensor([v], dtype=torch.float64)  # noqa: E731
    out = PreferenceLoss(loss, **kw)(t(CHOSEN), t(REJECTED), t(REF_CHOSEN), t(REF_REJECTED), t(TOKENS_CHOSEN),
                                     t(TOKENS_REJECTED))
    return tuple(x.item() for x in out)


def _softplus(x: float) -> float:  # -log(sigmoid(-x))
    return math.log1p(math.exp(x))


def test_sigmoid_is_dpo_with_conservative_label_smoothing():
    # logits = (-3 - -5) - (-4 - -4) = 2; beta 0.1: -log sigmoid(0.2)
    loss, chosen, rejected = _one("sigmoid", beta=0.1)
    assert loss == pytest.approx(_softplus(-0.2), abs=1e-12) and loss == pytest.approx(0.598138869381, abs=1e-9)
    assert (chosen, rejected) == (pytest.approx(0.1), pytest.approx(-0.1))
    smoothed, _, _ = _one("sigmoid", beta=0.1, label_smoothing=0.25)
    assert smoothed == pytest.approx(0.75 * _softplus(-0.2) + 0.25 * _softplus(0.2), abs=1e-12)


def test_ipo_takes_the_log_ratios_per_token_and_hinge_the_margin():
    # IPO: (1/2 - (-1)/4 - 1/(2*0.5))^2 = (0.75 - 1)^2 = 0.0625; rewards stay the summed ratios (TRL's)
    loss, chosen, rejected = _one("ipo", beta=0.5)
    assert loss == pytest.approx(0.0625, abs=1e-12)
    assert (chosen, rejected) == (pytest.approx(0.5), pytest.approx(-0.5))
    assert _one("hinge", beta=0.1)[0] == pytest.approx(0.8, abs=1e-12)  # relu(1 - 0.1 * 2)
    assert _one("hinge", beta=1.0)[0] == 0.0  # past the margin: no loss


def test_simpo_uses_mean_log_probs_and_no_reference():
    # mean log-probs -1.5 and -1.25; logits = -0.25 - gamma/beta = -0.25 - 0.25 = -0.5; beta 2
    out = PreferenceLoss("simpo", beta=2.0, simpo_gamma=0.5)(
        torch.tensor([CHOSEN]), torch.tensor([REJECTED]), None, None, torch.tensor([TOKENS_CHOSEN]),
        torch.tensor([TOKENS_REJECTED]))
    assert out[0].item() == pytest.approx(_softplus(1.0), abs=1e-6)
    assert (out[1].item(), out[2].item()) == (pytest.approx(-3.0), pytest.approx(-2.5))
    assert not PreferenceLoss("simpo").needs_reference and PreferenceLoss("ipo").needs_reference


def test_the_metric_sums_count_accuracy_and_margin_and_leave_out_weighted_pairs():
    objective = PreferenceLoss("sigmoid")
    losses, chosen = torch.tensor([0.5, 1.0, 2.0]), torch.tensor([1.0, 0.0, 3.0])
    rejected = torch.tensor([0.0, 1.0, 0.0])
    sums = objective.sums(losses, chosen, rejected, weight=torch.tensor([1.0, 1.0, 0.0]))
    assert sums.tolist() == [1.5, 1.0, 1.0, 1.0, 0.0]  # loss, chosen, rejected, accuracy (1 of 2), margin (1 - 1)


def test_response_log_probs_sum_the_labelled_tokens_scored_one_position_earlier():
    logits = torch.randn(2, 5, 7, generator=torch.Generator().manual_seed(0), requires_grad=True)
    labels = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, 3, 4, IGNORE_INDEX], [IGNORE_INDEX, 1, 2, 6, 0]])
    got = response_log_probs(logits, labels, IGNORE_INDEX)
    logp = torch.log_softmax(logits.detach(), dim=-1)
    want = [logp[0, 1, 3] + logp[0, 2, 4], logp[1, 0, 1] + logp[1, 1, 2] + logp[1, 2, 6] + logp[1, 3, 0]]
    assert torch.allclose(got.detach(), torch.stack(want), atol=1e-6)
    got.sum().backward()
    assert logits.grad[0, 3:].abs().sum() == 0 and logits.grad[1, :4].abs().sum() > 0  # unscored positions: none


@pytest.mark.parametrize("override,message", [
    ({"loss": "kto"}, "dpo.loss: expected one of sigmoid, ipo, hinge, simpo, got 'kto'"),
    ({"beta": 0.0}, "dpo.beta: expected a positive number"),
    ({"label_smoothing": 0.5}, "dpo.label_smoothing"),
    ({"sync_ref_model": True, "precompute_ref_log_probs": True}, "dpo.sync_ref_model: cannot be used here"),
    ({"loss": "simpo", "precompute_ref_log_probs": True}, "dpo.precompute_ref_log_probs: dpo.loss simpo"),
])
def test_bad_dpo_keys_are_one_line_refusals(override, message):
    section = OmegaConf.merge(OmegaConf.structured(DPOConfig), override)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as err:
        check_dpo_section(section, peft=False)
    assert "\n" not in str(err.value)


def test_lora_with_a_synced_reference_is_refused_and_pipeline_stages_are_not():
    section = OmegaConf.merge(OmegaConf.structured(DPOConfig), {"sync_ref_model": True})
    with pytest.raises(ConfigError, match="adapters disabled"):
        check_dpo_section(section, peft=True)
    check_dpo_section(OmegaConf.structured(DPOConfig), peft=False)


# ---------------------------------------------------------------------------- TRL itself (opt-in: pip install trl)

@pytest.mark.parametrize("loss", ["sigmoid", "ipo", "hinge"])
def test_losses_and_rewards_equal_trl_dpo_trainer_on_the_same_log_probs(loss):
    trl = pytest.importorskip("trl")
    pairs, length = 4, 9
    g = torch.Generator().manual_seed(3)
    completion = torch.zeros(2 * pairs, length, dtype=torch.long)
    for row in range(2 * pairs):  # prompts of 3 tokens, responses of 2..5
        completion[row, 3:3 + 2 + row % 4] = 1
    shifted = completion[:, 1:]
    per_token = -torch.rand(2 * pairs, length - 1, generator=g, dtype=torch.float64) * shifted
    ref = -torch.rand(2, pairs, generator=g, dtype=torch.float64) * 4
    outputs = SimpleNamespace(log_probs=per_token, entropy=torch.zeros_like(per_token),
                              mean_logits=torch.zeros_like(per_token),
                              is_top1=torch.zeros_like(shifted, dtype=torch.bool))
    fake = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=SimpleNamespace(device="cpu", gather=lambda x: x,
                                                                          gather_for_metrics=lambda x: x),
        aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl",
        loss_types=[loss], loss_weights=[1.0], beta=0.3, label_smoothing=0.0, use_weighting=False,
        _metrics=defaultdict(lambda: defaultdict(list)), _total_train_tokens=0, _tp_size=1, args=SimpleNamespace())
    inputs = {"input_ids": torch.ones(2 * pairs, length, dtype=torch.long),
              "attention_mask": torch.ones_like(completion), "completion_mask": completion, "ref_chosen_logps": ref[0], "ref_rejected_logps": ref[1]}
    trl_loss = trl.DPOTrainer._compute_loss(fake, lambda **_: outputs, inputs, return_outputs=False)
    sums, tokens = per_token.sum(dim=1), shifted.sum(dim=1).double()
    losses, chosen, rejected = PreferenceLoss(loss, beta=0.3)(sums[:pairs], sums[pairs:], ref[0], ref[1],
                                                              tokens[:pairs], tokens[pairs:])
    assert abs(losses.mean().item() - float(trl_loss)) < 1e-6
    metrics = fake._metrics["train"]
    assert abs(chosen.mean().item() - metrics["rewards/chosen"][0]) < 1e-6
    assert abs(rejected.mean().item() - metrics["rewards/rejected"][0]) < 1e-6
    assert abs((chosen > rejected).double().mean().item() - metrics["rewards/accuracies"][0]) < 1e-9


def test_rpo_adds_the_chosen_responses_negative_log_likelihood_per_token():
    plain, _, _ = _one("sigmoid", beta=0.1)
    with_rpo, chosen, _ = _one("sigmoid", beta=0.1, rpo_alpha=0.5)
    assert with_rpo == pytest.approx(plain + 0.5 * 3.0 / 2.0, abs=1e-12) and chosen == pytest.approx(0.1)
