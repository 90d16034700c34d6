"""Run under ``torch.distributed.run --nproc-per-node 2``: on ``dp 2 × ep 2`` (``shard_model`` as a run does it), each
rank on rows of its own, the loss, every gradient and the clipped norm are those of ``dp 2`` and of the whole model.

``python -m torch.distributed.run --nproc-per-node 2 expert_parallel_gradients.py FAMILY...`` (Mixtral, Qwen3-MoE;
``FAMILY+lora``: with random LoRA adapters on the attention, the adapters' gradients, the experts frozen).
"""

from __future__ import annotations

import copy
import sys

import torch
from omegaconf import OmegaConf

from automodel_ckpt.distributed.env import all_reduce_sum, end_process, init_distributed, shutdown_distributed
from automodel_ckpt.distributed.fsdp import shard_model
from automodel_ckpt.distributed.mesh import build_parallel_dims, resolve_sizes
from automodel_ckpt.distributed.tensor_parallel import clip_grad_norm
from tests.family_bases import family_config


def _summed_loss(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels.flatten(),
                                             ignore_index=-100, reduction="sum")


def _sharded_run(model: torch.nn.Module, ids, mask, rank: int, dp: int, tokens: float):
    """As ``train_step``: this rank's rows, summed loss scaled by dp / global tokens; loss, gradients and norm."""
    rows = slice(rank * len(ids) // dp, (rank + 1) * len(ids) // dp)
    summed = _summed_loss(model, ids[rows], mask[rows])
    (summed * dp / tokens).backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.requires_grad}
    norm = clip_grad_norm(model.parameters(), 1.0)
    return all_reduce_sum(summed.detach().double()) / tokens, grads, norm


def main(families: list[str]) -> None:
    from transformers import AutoModelForCausalLM

    env = init_distributed("gloo", 10)
    dp = build_parallel_dims(resolve_sizes(OmegaConf.create({}), env.world_size), env.rank, "cpu")
    ep = build_parallel_dims(resolve_sizes(OmegaConf.create({"ep_size": 2}), env.world_size), env.rank, "cpu")
    for name in families:
        family, lora = name.removesuffix("+lora"), name.endswith("+lora")
        torch.manual_seed(0)
        whole = AutoModelForCausalLM.from_config(family_config(family))
        if lora:
            from automodel_ckpt.config.schema import PeftConfig
            from automodel_ckpt.models.lora import apply_lora

            whole = apply_lora(whole, OmegaConf.structured(PeftConfig(init_lora_weights=False)))
        ids = torch.randint(4, whole.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))
        mask = torch.ones_like(ids)
        mask[1, 11:] = 0
        mask[2, 5:] = 0
        tokens = float((mask[:, 1:] != 0).sum())
        runs = {mesh: _sharded_run(shard_model(copy.deepcopy(whole), dims), ids, mask, env.rank, 2, tokens)
                for mesh, dims in (("dp", dp), ("ep", ep))}
        loss = _summed_loss(whole, ids, mask) / tokens
        loss.backward()
        want = {n: p.grad for n, p in whole.named_parameters() if p.requires_grad}
        norm = torch.nn.utils.get_total_norm(list(want.values()))
        for mesh, (got_loss, got, got_norm) in runs.items():
            assert sorted(got) == sorted(want), (name, mesh)
            assert abs(got_loss.item() - loss.item()) < 1e-5, (name, mesh, got_loss, loss)
            worst = max((got[n] - want[n]).abs().max().item() for n in want)
            assert worst < 1e-5, (name, mesh, worst)
            assert abs(float(got_norm) - float(norm)) < 1e-5 * float(norm), (name, mesh, got_norm, norm)
        ep_loss, ep_grads, ep_norm = runs["ep"]
        dp_loss, dp_grads, dp_norm = runs["dp"]
        assert abs(ep_loss.item() - dp_loss.item()) < 1e-5 and abs(float(ep_norm) - float(dp_norm)) < 1e-5
        assert max((ep_grads[n] - dp_grads[n]).abs().max().item() for n in want) < 1e-5
        if env.rank == 0:
            print(f"{name}: dp 2 × ep 2 loss, grad norm and {len(want)} gradients equal dp 2's and the whole "
                  "model's", flush=True)
    shutdown_distributed()


if __name__ == "__main__":
    main(sys.argv[1:])
    end_process(0)  # never the interpreter's teardown while gloo's threads may still run (see end_process)
