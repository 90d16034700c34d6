"""FSDP2 blocks gathered once for a run of forwards (sampling), then resharded as before."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig, LlamaForCausalLM

from automodel_ckpt.distributed.fsdp import data_parallel_mesh, gathered_between_forwards, shard_model
from automodel_ckpt.training.rollout import generate


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, eos_token_id=1,
                                        pad_token_id=0)).eval()


def _sharded_weight(model) -> bool:
    return isinstance(model.model.layers[0].mlp.up_proj.weight, DTensor)


def test_blocks_stay_gathered_between_forwards_inside_and_are_resharded_after(process_group):
    plain, sharded = _model(), shard_model(_model(), data_parallel_mesh(torch.device("cpu"), 1))
    prompts, seeds = [[2, 5, 6, 7], [2, 9]], [11, 12]
    kw = dict(max_new_tokens=5, temperature=1.0, eos_id=None, pad_id=0)
    want = generate(plain, prompts, seeds, **kw)
    with gathered_between_forwards(sharded):
        got = generate(sharded, prompts, seeds, **kw)
        assert not _sharded_weight(sharded)  # gathered by the first forward, kept for the next ones
    assert got == want
    assert _sharded_weight(sharded)  # resharded on the way out
    with torch.no_grad():
        sharded(input_ids=torch.tensor([[2, 5, 6]]))
    assert _sharded_weight(sharded)  # and resharded after each forward again, as before
    with gathered_between_forwards(plain):  # no FSDP2 blocks: nothing to do
        assert generate(plain, prompts, seeds, **kw) == want
    with gathered_between_forwards(sharded, budget=1024):  # the whole weights would not fit: gathered per forward
        assert generate(sharded, prompts, seeds, **kw) == want
        assert _sharded_weight(sharded)


def test_an_untied_models_embedding_and_head_are_units_of_their_own_and_a_tied_ones_stay_in_the_root(process_group):
    from torch.distributed.fsdp import FSDPModule

    mesh = data_parallel_mesh(torch.device("cpu"), 1)
    untied = shard_model(_model(), mesh)  # LlamaConfig's default: untied
    assert isinstance(untied.model.embed_tokens, FSDPModule) and isinstance(untied.lm_head, FSDPModule)
    with torch.no_grad():
        untied(input_ids=torch.tensor([[2, 5, 6]]))
    assert isinstance(untied.lm_head.weight, DTensor)  # resharded after its forward, not held by the root
    torch.manual_seed(0)
    tied = shard_model(LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64,
                                                    num_hidden_layers=2, num_attention_heads=4,
                                                    num_key_value_heads=2, tie_word_embeddings=True)), mesh)
    assert not isinstance(tied.model.embed_tokens, FSDPModule) and not isinstance(tied.lm_head, FSDPModule)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
