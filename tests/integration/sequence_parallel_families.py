"""Run under ``torch.distributed.run --nproc-per-node 2``: families whose plans take other paths through sequence
parallelism give, on ``tp 2 + SP`` (``shard_model`` as a run does it), the loss and gradients of the whole model.

``python -m torch.distributed.run --nproc-per-node 2 sequence_parallel_families.py FAMILY...``: Gemma (tied, scaled
embeddings), Phi-3 (fused projections, ``rowwise_split_input``), Mixtral (whole experts), Qwen3-MoE (whole experts,
per-head norms), on rows with padding.
"""

from __future__ import annotations

import copy
import sys

import torch
from omegaconf import OmegaConf

from automodel_ckpt.distributed.env import end_process, init_distributed, shutdown_distributed
from automodel_ckpt.distributed.fsdp import shard_model
from automodel_ckpt.distributed.mesh import build_parallel_dims, resolve_sizes
from tests.family_bases import family_config


def _loss_and_grads(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor):
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    loss.backward()
    grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad) for n, p in
             model.named_parameters()}
    return loss.detach(), grads


def main(families: list[str]) -> None:
    from transformers import AutoModelForCausalLM

    env = init_distributed("gloo", 10)
    dims = build_parallel_dims(resolve_sizes(OmegaConf.create({"tp_size": 2, "sequence_parallel": True}),
                                             env.world_size), env.rank, "cpu")
    for family in families:
        config = family_config(family)
        config.num_attention_heads, config.num_key_value_heads = 4, 2
        torch.manual_seed(0)
        whole = AutoModelForCausalLM.from_config(config)
        split = shard_model(copy.deepcopy(whole), dims)
        ids = torch.randint(4, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
        mask = torch.ones_like(ids)
        mask[1, 11:] = 0
        want_loss, want = _loss_and_grads(whole, ids, mask)
        got_loss, got = _loss_and_grads(split, ids, mask)
        assert sorted(got) == sorted(want), family
        assert torch.allclose(got_loss, want_loss, rtol=0, atol=1e-5), (family, got_loss, want_loss)
        worst = max((got[n] - want[n]).abs().max().item() for n in want)
        assert worst < 1e-5, (family, worst)
        if env.rank == 0:
            print(f"{family}: tp 2 + SP loss and {len(want)} gradients equal the whole model's", flush=True)
    shutdown_distributed()


if __name__ == "__main__":
    main(sys.argv[1:])
    end_process(0)  # never the interpreter's teardown while gloo's threads may still run (see end_process)
