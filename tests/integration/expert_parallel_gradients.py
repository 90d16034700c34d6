"""Run under ``torch.distributed.run``: with expert parallelism (``shard_model`` as a run does it), each data-parallel
rank on rows of its own, the loss, every gradient and the clipped norm are those of the same mesh without it and of
the whole model.

``python -m torch.distributed.run --nproc-per-node 2 expert_parallel_gradients.py FAMILY...``: ``dp 2 × ep 2``
against ``dp 2`` (Mixtral, Qwen3-MoE; ``FAMILY+lora``: with random LoRA adapters on the attention, the adapters'
gradients, the experts frozen). On 4 processes: ``dp 2 × tp 2 × ep 2`` (the ep groups are the tensor-parallel
groups) and ``dp 2 × tp 2 × ep 4 + SP`` (one expert per rank, sequence parallelism) against ``dp 2 × tp 2``.
"""

from __future__ import annotations

import copy
import sys

import torch
from omegaconf import OmegaConf

from automodel_ckpt.distributed.env import end_process, init_distributed, shutdown_distributed
from automodel_ckpt.distributed.fsdp import shard_model
from automodel_ckpt.distributed.mesh import build_parallel_dims, resolve_sizes
from automodel_ckpt.distributed.tensor_parallel import clip_grad_norm
from tests.family_bases import family_config


def _summed_loss(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels.flatten(),
                                             ignore_index=-100, reduction="sum")


def _sharded_run(model: torch.nn.Module, ids, mask, dims, tokens: float):
    """As ``train_step``: this data-parallel rank's rows, summed loss scaled by dp / global tokens; loss, gradients
    and norm."""
    dp, rank = dims.dp_size, dims.dp_rank
    rows = slice(rank * len(ids) // dp, (rank + 1) * len(ids) // dp)
    summed = _summed_loss(model, ids[rows], mask[rows])
    (summed * dp / tokens).backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.requires_grad}
    norm = clip_grad_norm(model.parameters(), 1.0)
    return dims.sum_over_dp(summed.detach().double()) / tokens, grads, norm


def main(families: list[str]) -> None:
    from transformers import AutoModelForCausalLM

    env = init_distributed("gloo", 10)
    tp = {"tp_size": 2} if env.world_size == 4 else {}
    sp = {"sequence_parallel": True}
    meshes = {"dp": tp} | ({"ep 2": tp | {"ep_size": 2}, "ep 4": tp | sp | {"ep_size": 4}} if tp else
                           {"ep": {"ep_size": 2}})
    meshes = {name: build_parallel_dims(resolve_sizes(OmegaConf.create(keys), env.world_size), env.rank, "cpu")
              for name, keys in meshes.items()}
    for name in families:
        family, lora = name.removesuffix("+lora"), name.endswith("+lora")
        torch.manual_seed(0)
        config = family_config(family)
        config.num_attention_heads, config.num_key_value_heads = 4, 2  # heads tp 2 splits
        whole = AutoModelForCausalLM.from_config(config)
        if lora:
            from automodel_ckpt.config.schema import PeftConfig
            from automodel_ckpt.models.lora import apply_lora

            whole = apply_lora(whole, OmegaConf.structured(PeftConfig(init_lora_weights=False)))
        ids = torch.randint(4, whole.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))
        mask = torch.ones_like(ids)
        mask[1, 11:] = 0
        mask[2, 5:] = 0
        tokens = float((mask[:, 1:] != 0).sum())
        runs = {mesh: _sharded_run(shard_model(copy.deepcopy(whole), dims), ids, mask, dims, tokens)
                for mesh, dims in meshes.items()}
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
        dp_loss, dp_grads, dp_norm = runs.pop("dp")
        for mesh, (ep_loss, ep_grads, ep_norm) in runs.items():
            assert abs(ep_loss.item() - dp_loss.item()) < 1e-5 and abs(float(ep_norm) - float(dp_norm)) < 1e-5
            assert max((ep_grads[n] - dp_grads[n]).abs().max().item() for n in want) < 1e-5, (name, mesh)
            if env.rank == 0:
                print(f"{name}: {meshes[mesh].sizes.describe()} loss, grad norm and {len(want)} gradients equal "
                      f"{meshes['dp'].sizes.describe()}'s and the whole model's", flush=True)
    shutdown_distributed()


if __name__ == "__main__":
    main(sys.argv[1:])
    end_process(0)  # never the interpreter's teardown while gloo's threads may still run (see end_process)
