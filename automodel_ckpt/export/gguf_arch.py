"""Which model families a GGUF export knows, and for each its llama.cpp architecture, hyperparameters and tensors.

A family is listed when both llama.cpp and transformers' GGUF reader run it. Names come from the ``gguf`` library's
``TensorNameMap``; what llama.cpp's converter does to values besides renaming is repeated here per family
(``GGUFFamily``'s flags; experts stacked per layer), and nothing else. Any other family is refused in one line.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from automodel_ckpt.errors import CheckpointError, UserError
from automodel_ckpt.export.model_source import layer_count

_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)"
                     r"\.weight$")


@dataclass(frozen=True)
class GGUFFamily:
    """One family's GGUF shape: the ``gguf.MODEL_ARCH`` member's name and what differs from a plain decoder."""

    arch: str
    llama_rope: bool = False  # Llama/Mistral: q and k rows permuted into llama.cpp's interleaved rotary layout
    conv1d: bool = False  # GPT-2: Conv1D weights are (in, out) on disk, (out, in) in a GGUF
    copy_tied_output: bool = False  # GPT-2: ``output.weight`` written beside ``token_embd.weight``
    moe: bool = False
    norm_plus_one: bool = False  # Gemma 2: norms scale by (1 + w) in transformers, by w in llama.cpp
    required_tokens: tuple[str, ...] = ()  # tokens llama.cpp looks up by text when it loads the architecture


_FAMILIES: dict[str, GGUFFamily] = {
    "llama": GGUFFamily("LLAMA", llama_rope=True),
    "mistral": GGUFFamily("LLAMA", llama_rope=True),  # as llama.cpp's converter writes it: Llama's computation
    "qwen2": GGUFFamily("QWEN2"),
    "qwen3": GGUFFamily("QWEN3"),
    "qwen2_moe": GGUFFamily("QWEN2MOE", moe=True),
    "qwen3_moe": GGUFFamily("QWEN3MOE", moe=True),
    "phi3": GGUFFamily("PHI3", required_tokens=("<unk>", "<s>", "</s>", "<|endoftext|>")),
    "gpt2": GGUFFamily("GPT2", conv1d=True, copy_tied_output=True),
    "gemma2": GGUFFamily("GEMMA2", norm_plus_one=True),
    "starcoder2": GGUFFamily("STARCODER2"),
    "gemma3_text": GGUFFamily("GEMMA3", norm_plus_one=True),
}


def family_for(config: dict[str, Any]) -> GGUFFamily:
    """The GGUF shape of the model of ``config``; a one-line ``UserError`` for a family GGUF export does not know,
    or a configuration llama.cpp would run differently from transformers."""
    model_type = str(config.get("model_type"))
    family = _FAMILIES.get(model_type)
    if family is None:
        raise UserError(f"GGUF export does not know the model family '{model_type}'; it exports "
                        f"{', '.join(sorted(_FAMILIES))} (families that llama.cpp and transformers' GGUF reader "
                        "both run); use the Hugging Face export (`ckpt-train consolidate`) for this model")
    rope = rope_parameters(config)
    if rope.get("rope_type", "default") not in ("default", None):
        raise UserError(f"GGUF export: rope scaling '{rope.get('rope_type')}' of this {model_type} model is not "
                        "exported yet; only unscaled rotary embeddings are")
    if model_type == "qwen3_moe" and not config.get("norm_topk_prob", False):
        raise UserError("GGUF export: this qwen3_moe model has norm_topk_prob false, but llama.cpp always "
                        "normalises the chosen experts' weights for qwen3moe; it would run a different model")
    if model_type in ("gemma2", "gemma3_text") and config.get("query_pre_attn_scalar") != config.get("head_dim"):
        raise UserError(f"GGUF export: this {model_type} model scales queries by query_pre_attn_scalar "
                        f"{config.get('query_pre_attn_scalar')}, llama.cpp by its head size {config.get('head_dim')}")
    local = (config.get("rope_parameters") or {}).get("sliding_attention") or {}
    if model_type == "gemma3_text" and float(local.get("rope_theta", 10000.0)) != 10000.0:
        raise UserError("GGUF export: llama.cpp runs gemma3's sliding-window layers with rope base 10000; this model's "
                        f"is {local.get('rope_theta')}")
    if model_type == "phi3" and (config.get("rope_scaling") or {}).get("long_factor"):
        raise UserError("GGUF export: phi3 long-context rope scaling is not exported yet")
    return family


def rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """The rotary settings, where transformers 5 keeps them (``rope_parameters``, per attention kind for Gemma 3:
    its full attention's here) or 4.x did (top level)."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    if isinstance(params.get("full_attention"), dict):
        params = dict(params["full_attention"])
    if "rope_theta" not in params and "rope_theta" in config:
        params["rope_theta"] = config["rope_theta"]
    if "rope_type" not in params and "type" in params:
        params["rope_type"] = params["type"]
    return params


def add_hparams(writer: Any, family: GGUFFamily, config: dict[str, Any]) -> None:
    """The architecture's hyperparameters, under the keys llama.cpp's converter writes."""
    c = config
    if family.arch == "GPT2":
        writer.add_block_count(c["n_layer"])
        writer.add_context_length(c["n_positions"])
        writer.add_embedding_length(c["n_embd"])
        writer.add_feed_forward_length(c.get("n_inner") or 4 * c["n_embd"])
        writer.add_head_count(c["n_head"])
        writer.add_layer_norm_eps(c["layer_norm_epsilon"])
        return
    heads, hidden = c["num_attention_heads"], c["hidden_size"]
    head_dim = c.get("head_dim") or hidden // heads
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(c.get("num_key_value_heads") or heads)
    if "rms_norm_eps" in c:
        writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    else:  # LayerNorm families (starcoder2)
        writer.add_layer_norm_eps(c.get("norm_epsilon") or c.get("layer_norm_eps") or 1e-5)
    theta = rope_parameters(c).get("rope_theta")
    if theta is not None:
        writer.add_rope_freq_base(float(theta))
    if head_dim != hidden // heads or family.arch in ("QWEN3", "QWEN3MOE", "GEMMA2", "GEMMA3"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if family.arch == "LLAMA":
        writer.add_rope_dimension_count(head_dim)
        writer.add_vocab_size(c["vocab_size"])
    if family.arch == "PHI3":
        rotary = float(c.get("partial_rotary_factor") or 1.0)
        writer.add_rope_dimension_count(int(rotary * hidden) // heads)
        writer.add_sliding_window(int(c.get("sliding_window") or 0))
    if family.arch == "GEMMA2":
        writer.add_attn_logit_softcapping(float(c.get("attn_logit_softcapping") or 0.0))
        writer.add_final_logit_softcapping(float(c.get("final_logit_softcapping") or 0.0))
    if family.arch in ("GEMMA2", "GEMMA3"):
        writer.add_sliding_window(int(c.get("sliding_window") or 0))
    if family.moe:
        writer.add_expert_count(c.get("num_experts") or c.get("num_local_experts"))
        writer.add_expert_used_count(c["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(c["moe_intermediate_size"])
        if c.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])


@dataclass
class OutputTensor:
    """One GGUF tensor: its name and shape (outermost first), the on-disk tensors it is made of and how."""

    name: str
    shape: tuple[int, ...]
    sources: list[str]
    make: Callable[[list[torch.Tensor]], torch.Tensor] = field(default=lambda ts: ts[0])
    kind: str = ""  # "norm", "router", "position", "embedding", "output" or "" (what picks its storage type)


def output_tensors(family: GGUFFamily, config: dict[str, Any],
                   shapes: dict[str, tuple[int, ...]]) -> list[OutputTensor]:
    """Every GGUF tensor of the model whose on-disk tensors have ``shapes``, in llama.cpp's order."""
    import gguf

    arch = getattr(gguf.MODEL_ARCH, family.arch)
    blocks = layer_count(config, shapes, "GGUF export")
    names = gguf.get_tensor_name_map(arch, blocks)  # a map per block: its count was checked against the tensors
    experts: dict[tuple[str, str], dict[int, str]] = {}
    out: list[OutputTensor] = []
    unmapped = []
    for name in shapes:
        m = _EXPERT.match(name)
        if m and family.moe:
            experts.setdefault((m["prefix"], m["proj"]), {})[int(m["expert"])] = name
            continue
        if name.endswith(".attn.bias") or name.endswith(".attn.masked_bias") or name.endswith("rotary_emb.inv_freq"):
            continue  # buffers some folders carry: not weights
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if new is None:
            unmapped.append(name)
            continue
        out.append(_plain(family, config, name, new, shapes[name]))
    for (prefix, proj), by_expert in sorted(experts.items()):
        new = names.get_name(f"{prefix}.{proj}.weight", try_suffixes=(".weight",))
        if new is None or sorted(by_expert) != list(range(len(by_expert))):
            unmapped.extend(by_expert.values())
            continue
        sources = [by_expert[e] for e in range(len(by_expert))]
        out.append(OutputTensor(new, (len(sources), *shapes[sources[0]]), sources, lambda ts: torch.stack(ts)))
    if unmapped:
        raise UserError(f"GGUF export: {len(unmapped)} tensor(s) of this {config.get('model_type')} model have no "
                        f"GGUF name ({', '.join(sorted(unmapped)[:3])}); the model differs from what llama.cpp runs")
    if family.copy_tied_output and not any(t.name == "output.weight" for t in out):
        embd = next(t for t in out if t.name == "token_embd.weight")
        out.append(OutputTensor("output.weight", embd.shape, embd.sources, kind="output"))
    return sorted(out, key=_order)


def checked_heads(config: dict[str, Any], key: str, rows: int, fallback: int | None = None, *,
                  whose: str = "GGUF export: config.json's", of: str = "projection's") -> int:
    """A head count of ``config`` that divides a projection's ``rows`` into heads of an even size (the rotary
    permutation's reshape), else one line (``whose`` config, the rows ``of`` what)."""
    value = config.get(key) if config.get(key) is not None else fallback
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or rows % (2 * value):
        raise CheckpointError(f"{whose} {key} is {str(value)[:40]}, which does not divide the {of} {rows} rows "
                              "into heads")
    return value


def _plain(family: GGUFFamily, config: dict[str, Any], name: str, new: str, shape: tuple[int, ...]) -> OutputTensor:
    kind = ""
    if len(shape) <= 1 or new.endswith("_norm.weight"):
        kind = "norm"
    elif ".ffn_gate_inp" in new:
        kind = "router"
    elif new.startswith("position_embd"):
        kind = "position"
    elif new.startswith("token_embd"):
        kind = "embedding"
    elif new.startswith("output."):
        kind = "output"
    make: Callable[[list[torch.Tensor]], torch.Tensor] = lambda ts: ts[0]
    if new.endswith(".ffn_gate_inp_shexp.weight") and len(shape) == 2 and shape[0] == 1:
        shape, kind = (shape[1],), "norm"  # the shared expert's gate: one row, stored as a vector (llama.cpp's shape)
        make = lambda ts: ts[0].reshape(-1)  # noqa: E731
    elif family.norm_plus_one and name.endswith("norm.weight"):
        make = lambda ts: ts[0].float() + 1  # noqa: E731 - llama.cpp's converter does the same
    elif family.llama_rope and new.endswith((".attn_q.weight", ".attn_k.weight")):
        heads = checked_heads(config, "num_attention_heads", shape[0]) if ".attn_q." in new else None
        kv = heads if heads is not None else checked_heads(config, "num_key_value_heads", shape[0],
                                                            config.get("num_attention_heads"))
        make = lambda ts, kv=kv: permute_rotary(ts[0], kv)  # noqa: E731
    elif family.conv1d and len(shape) == 2 and new.endswith(
            (".attn_qkv.weight", ".attn_output.weight", ".ffn_up.weight", ".ffn_down.weight")):
        shape = (shape[1], shape[0])
        make = lambda ts: ts[0].t()  # noqa: E731
    return OutputTensor(new, tuple(shape), [name], make, kind)


def permute_rotary(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter: each head's rotary halves interleaved (``LlamaModel.permute``)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _order(t: OutputTensor) -> tuple[int, int, str]:
    m = re.match(r"^blk\.(\d+)\.", t.name)
    if m:
        return (1, int(m.group(1)), t.name)
    return (0 if t.name.startswith(("token_embd", "position_embd")) else 2, 0, t.name)
