"""``import --check``'s logits comparison: bitwise for the same fp32 weights, a difference shown otherwise."""

from __future__ import annotations

import torch

from automodel_ckpt.interop.check import compare, probe_inputs


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1))


def test_the_same_weights_give_bitwise_logits_and_others_do_not():
    model = _model()
    same = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert "largest difference 0, bitwise equal" in compare(model, same)
    assert probe_inputs(64).shape == (2, 16) and int(probe_inputs(64).max()) < 64
    moved = dict(same, **{"lm_head.weight": same["lm_head.weight"] + 1e-2})
    line = compare(model, moved)
    assert "bitwise" not in line and "DIFFERENT" in line, line
    halved = {n: t.to(torch.bfloat16) for n, t in same.items()}  # a bf16 run's module: (float32 vs bfloat16) named
    assert "(bfloat16)" in compare(model, halved)
    assert torch.equal(model.lm_head.weight, same["lm_head.weight"])  # the model itself untouched
