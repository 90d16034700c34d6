"""Tiny bases of several model families, built from config and saved with save_pretrained (bf16), for tests."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from automodel_ckpt.ondisk import layout
from automodel_ckpt.export.hf_metadata import write_hf_metadata
from automodel_ckpt.models.tiny import build_tokenizer

#: Families the export, resume and LoRA tests cover, with what makes each one interesting.
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": {"tie_word_embeddings": True},  # tied embeddings, q/k/v biases
    "gemma": {"head_dim": 32},  # tied embeddings
    "phi3": {},  # fused qkv_proj / gate_up_proj
    "gpt2": {"n_embd": 64, "n_layer": 2, "n_head": 2, "n_positions": 64},  # Conv1D, tied
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},  # experts fused in memory
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 32},
}


def family_config(family: str) -> Any:
    from transformers import AutoConfig

    tok = build_tokenizer()
    kwargs: dict[str, Any] = {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "vocab_size": len(tok), "max_position_embeddings": 64,
        "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id,
    }  # fmt: skip
    kwargs.update(FAMILIES[family])
    return AutoConfig.for_model(family, **kwargs)


def build_family_base(family: str, folder: Path, two_files: bool = True) -> Path:
    """A bf16 base of ``family`` in ``folder`` (two weight files and an index when ``two_files``), with tokenizer."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config(family)).to(torch.bfloat16)
    total = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    limit = int(math.ceil(total * 0.55)) if two_files else 10 * total
    model.save_pretrained(folder, max_shard_size=limit)
    build_tokenizer().save_pretrained(folder)
    return folder


def in_memory_state(base: Path, noise: float = 0.0) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The base loaded in fp32 (optionally perturbed, as training would) and its in-memory state dict."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if noise:
        torch.manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * noise)
    return model, model.state_dict()


def _save_rank_shards(state: dict[str, torch.Tensor], model_dir: Path, split_dim: int = 0) -> None:
    """Two ranks' safetensors shards as FSDP2 writes them: each tensor split in two along ``split_dim``."""
    model_dir.mkdir(parents=True)
    for rank in range(2):
        pieces, info = {}, {}
        for name, t in state.items():
            dim = split_dim if t.dim() > split_dim else 0
            rows = math.ceil(t.shape[dim] / 2)
            lo, hi = rank * rows, min(t.shape[dim], (rank + 1) * rows)
            if lo >= hi:
                continue
            pieces[name] = t.narrow(dim, lo, hi - lo).contiguous().clone()
            info[name] = {"saved_offsets": [lo if d == dim else 0 for d in range(t.dim())]}
        meta = {"format": "pt", "DCP_SHARDING_INFO": json.dumps(info)}
        save_file(pieces, model_dir / layout.model_shard_file(rank, 1, 1), metadata=meta)


def checkpoint_of(base: Path, root: Path, fmt: str, noise: float = 0.0, split_dim: int = 0):
    """A checkpoint's ``model/`` folder of ``base`` as ckpt-train writes it (2-rank shards, or DCP), no processes."""
    model, state = in_memory_state(base, noise)
    model_dir = root / "epoch_0_step_4" / layout.MODEL_DIR
    if fmt == "safetensors":
        _save_rank_shards(state, model_dir, split_dim)
    else:
        import torch.distributed.checkpoint as dcp

        dcp.save({k: v.clone() for k, v in state.items()}, checkpoint_id=str(model_dir), no_dist=True)
    world_size = 2 if fmt == "safetensors" else 1
    write_hf_metadata(model_dir, hf_config=model.config, base_model_path=base, world_size=world_size)
    return model, model_dir


def folder_weights(folder: Path) -> dict[str, tuple[str, torch.Tensor]]:
    """name -> (file, tensor) over every safetensors file of an HF folder."""
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        out.update({name: (path.name, t) for name, t in load_file(path).items()})
    return out


def row_shares(folder: Path, ranks: int) -> tuple[int, int]:
    """``(bytes of tensor data in the folder's safetensors files, the most one of ``ranks`` FSDP ranks may read)``:
    per tensor, the first rank's rows of dim 0 (it holds the most when they do not divide evenly)."""
    from automodel_ckpt.ondisk.formats.safetensors_io import read_header, tensor_entries

    data, share = 0, 0
    for file in sorted(folder.glob("*.safetensors")):
        header, _ = read_header(file)
        for entry in tensor_entries(header).values():
            start, end = entry["data_offsets"]
            data += end - start
            rows = entry["shape"][0] if entry["shape"] else 1
            share += math.ceil(rows / ranks) * (end - start) // max(rows, 1)
    return data, share
