"""Tiny bases of several model families, built from config and saved with save_pretrained (bf16), for tests."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

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
