"""Run under ``torch.distributed.run --nproc-per-node 4``: a tiny Llama and its AdamW state, saved by the
Checkpointer on one mesh and loaded on another, equal what was saved bit for bit (gathered with ``full_tensor``).

``python -m torch.distributed.run --nproc-per-node 4 reshard_tensors.py ROOT FORMAT``: dp 4 → dp 2 × tp 2 →
HSDP 2 × 2, each leg saving after one optimizer step (non-zero moments) and the next loading that checkpoint.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

from automodel_ckpt.checkpoint.checkpointer import Checkpointer
from automodel_ckpt.checkpoint.config import CheckpointConfig
from automodel_ckpt.ondisk.info import SaveInfo
from automodel_ckpt.distributed.env import end_process, init_distributed, shutdown_distributed
from automodel_ckpt.distributed.fsdp import shard_model
from automodel_ckpt.distributed.mesh import build_parallel_dims, resolve_sizes

MESHES = [("dp 4", {}), ("dp 2 × tp 2", {"tp_size": 2}), ("HSDP 2 × 2", {"dp_replicate_size": 2})]


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else torch.as_tensor(t)).detach().clone()


def _leg(env, keys: dict, seed: int):
    """A model and AdamW on the mesh of ``keys``, after one step from ``seed``'s weights and batch."""
    from transformers import LlamaConfig, LlamaForCausalLM

    dims = build_parallel_dims(resolve_sizes(OmegaConf.create(keys), env.world_size), env.rank, "cpu")
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = shard_model(LlamaForCausalLM(config), dims)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return dims, model, optimizer


def _tensors(model, optimizer) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in model.named_parameters()}
    out = {f"model.{n}": _full(p) for n, p in model.named_parameters()}
    for p, state in optimizer.state.items():
        out |= {f"optim.{names[id(p)]}.{k}": _full(v) for k, v in state.items()}
    return out


def main(root: Path, fmt: str) -> None:
    env = init_distributed("gloo")
    saved, path = None, None
    for i, (name, keys) in enumerate(MESHES):
        dims, model, optimizer = _leg(env, keys, seed=i)
        cfg = CheckpointConfig(checkpoint_dir=str(root / f"leg{i}"), model_save_format=fmt, save_consolidated="false")
        ckpt = Checkpointer(cfg, env, resolved_config_yaml="seed: 1\n", say=lambda _m: None, dims=dims)
        states = {"model": model, "optimizer": optimizer}
        if saved is not None:  # this leg's own step is overwritten by the previous mesh's checkpoint
            assert not torch.equal(_tensors(model, optimizer)["model.model.embed_tokens.weight"],
                                   saved["model.model.embed_tokens.weight"])
            ckpt.load(states, path)
            got = _tensors(model, optimizer)
            assert sorted(got) == sorted(saved), (name, sorted(set(got) ^ set(saved)))
            for key, want in saved.items():
                assert got[key].dtype == want.dtype and torch.equal(got[key], want), (name, key)
            if env.rank == 0:
                print(f"{fmt}: {MESHES[i - 1][0]} -> {name}: {len(got)} tensors equal", flush=True)
        # one more step, so the next leg loads moments that moved on this mesh
        model(input_ids=torch.arange(16).reshape(1, 16), labels=torch.arange(16).reshape(1, 16)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        saved = _tensors(model, optimizer)
        path = ckpt.save(states, SaveInfo(epoch=0, step=i + 1, train_loss=1.0, val_loss=None, is_final=False))
        ckpt.finalize()
    shutdown_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
    end_process(0)  # never the interpreter's teardown while gloo's threads may still run (see end_process)
