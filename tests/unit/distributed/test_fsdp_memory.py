"""FSDP2 on the CPU: each reduce-scatter's input freed, the input embedding never gathered in backward (a backward's
memory at 2 ranks: tests/integration/test_memory_whole_run.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig, LlamaForCausalLM

from automodel_ckpt.distributed.fsdp import _FreedReduceScatter, data_parallel_mesh, shard_model


def _model(layers: int = 3) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                        num_attention_heads=4, num_key_value_heads=2))


def _gathered(module: torch.nn.Module) -> bool:
    """FSDP2 swaps a unit's parameters to plain tensors while gathered, back to DTensors when resharded."""
    return not isinstance(next(module.parameters()), DTensor)


def test_the_input_embedding_is_never_gathered_in_backward_and_gets_its_gradient(process_group):
    model = shard_model(_model(), data_parallel_mesh(torch.device("cpu"), 1))
    embedding, seen = model.model.embed_tokens, []
    embedding.register_forward_hook(  # a hook on its output's gradient: runs as its backward begins
        lambda module, args, out: out.register_hook(lambda grad: seen.append(_gathered(embedding))) and None)
    model.model.layers[0].mlp.down_proj.register_full_backward_pre_hook(
        lambda *_: seen.append(_gathered(model.model.layers[0])))
    model(input_ids=torch.tensor([[2, 5, 6, 7]]), labels=torch.tensor([[2, 5, 6, 7]])).loss.backward()
    assert seen == [True, False]  # a block is gathered for its backward; the embedding's reads token ids only
    want = _model()
    want(input_ids=torch.tensor([[2, 5, 6, 7]]), labels=torch.tensor([[2, 5, 6, 7]])).loss.backward()
    assert torch.equal(embedding.weight.grad.full_tensor(), want.model.embed_tokens.weight.grad)


def test_every_unit_on_the_cpu_reduce_scatters_with_its_input_freed_as_the_call_returns(process_group):
    model = shard_model(_model(1), data_parallel_mesh(torch.device("cpu"), 1))
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    assert len(units) == 4  # the block, the embedding, the head, the root
    for unit in units:  # where FSDP2 keeps a unit's comm (set_custom_reduce_scatter has no getter)
        assert all(isinstance(g._reduce_scatter_comm, _FreedReduceScatter) for g in unit._get_fsdp_state()._fsdp_param_groups)
    comm = _FreedReduceScatter()
    given = comm.allocate((6,), dtype=torch.float32, device=torch.device("cpu"))
    given.copy_(torch.arange(6.0))
    out = torch.empty(6)
    assert comm(out, given, group=dist.group.WORLD, op=dist.ReduceOp.SUM) is None
    assert torch.equal(out, torch.arange(6.0))  # one rank: its own shard, the whole input
    assert given.untyped_storage().nbytes() == 0  # freed, though FSDP2 still holds the tensor until the next one
