"""`export --to gguf --adapter`: a LoRA checkpoint's adapter as a GGUF LoRA adapter for llama.cpp's ``--lora``.

The format is llama.cpp's ``convert_lora_to_gguf.py``'s: each adapted weight's ``lora_a`` and ``lora_b`` under its
GGUF name, and ``adapter.lora.alpha`` (llama.cpp scales by alpha / rank, so an rsLoRA adapter gets the alpha that
gives its scale). What the base's export does to a weight is done to the factor it reaches (Llama's rotary
permutation of ``lora_b``'s rows); families whose weights are transposed or stacked in a GGUF are refused, as is an
adapter that trains whole modules.
"""

from __future__ import annotations

import functools
import math
import re
from pathlib import Path
from typing import Any

import torch

from automodel_ckpt.ondisk import CONFIG_FILE_LIMIT, SMALL_FILE_LIMIT, HFFolder, read_json
from automodel_ckpt.export.gguf_arch import checked_heads, family_for, permute_rotary
from automodel_ckpt.export.gguf_export import gguf_file
from automodel_ckpt.errors import CheckpointError, UserError

_FACTOR = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>[AB])(?:\.default)?\.weight$")
_TYPES = {"bf16": (torch.bfloat16, "BF16"), "f16": (torch.float16, "F16")}
_heads = functools.partial(checked_heads, whose="--adapter: the base's", of="factor's")


def write_gguf_adapter(src: Path, out: Path, type_name: str) -> dict[str, Any]:
    """Write the adapter of the LoRA checkpoint (or adapter folder) ``src`` to ``out``; returns what was written."""
    import gguf
    from gguf.quants import quant_shape_to_byte_shape
    from safetensors import safe_open

    from automodel_ckpt.export.lora_merge import adapter_folder, base_model_folder

    if type_name not in _TYPES:
        raise UserError(f"--adapter: the LoRA factors are written in bf16 or f16, not {type_name}; add --type f16")
    adapter = adapter_folder(Path(src))
    settings = read_json(HFFolder(adapter).adapter_config, "an adapter config", SMALL_FILE_LIMIT)
    if not isinstance(settings, dict) or settings.get("peft_type", "LORA") != "LORA":
        raise UserError(f"--adapter: {HFFolder(adapter).adapter_config} is not a LoRA adapter")
    if settings.get("modules_to_save"):
        raise UserError("--adapter: this adapter trains whole modules beside its LoRA factors "
                        f"({', '.join(settings['modules_to_save'])}); export it merged (without --adapter)")
    base = base_model_folder(adapter)
    config = read_json(HFFolder(base).config, "a model config", CONFIG_FILE_LIMIT, follow=True)
    family = family_for(config)
    if family.conv1d or family.moe:
        raise UserError(f"--adapter: {config.get('model_type')} adapters are not written as GGUF adapters yet; "
                        "export the checkpoint merged (without --adapter)")
    arch = getattr(gguf.MODEL_ARCH, family.arch)
    weights = HFFolder(adapter).adapter_weights
    if not weights.is_file():
        raise CheckpointError(f"{adapter} has no {HFFolder.adapter_weights}")
    with safe_open(str(weights), framework="pt") as f:
        keys = list(f.keys())
    names = gguf.get_tensor_name_map(arch, _blocks(config, keys, base))  # the adapter's layers only: bounded
    rank, alpha = settings.get("r") or 0, settings.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0 or \
            not isinstance(alpha if alpha is not None else 0, (int, float)) or isinstance(alpha, bool):
        raise CheckpointError(f"--adapter: {HFFolder(adapter).adapter_config} gives the rank {str(rank)[:40]} and "
                              f"alpha {str(alpha)[:40]}; expected numbers")
    alpha = float(alpha if alpha is not None else rank)
    if settings.get("use_rslora"):
        alpha *= math.sqrt(rank)  # llama.cpp scales by alpha / rank; rsLoRA by alpha / sqrt(rank)
    dtype, qname = _TYPES[type_name]
    out = Path(out)
    with gguf_file(out, gguf.MODEL_ARCH_NAMES[arch]) as writer, safe_open(str(weights), framework="pt") as f:
        factors = _factors(list(f.keys()), names, weights)
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
        for gguf_name, key, which, module in factors:
            value = f.get_tensor(key)
            if which == "B" and family.llama_rope and gguf_name.endswith((".attn_q.weight", ".attn_k.weight")):
                heads = _heads(config, "num_attention_heads", value.shape[0]) if ".attn_q." in gguf_name \
                    else _heads(config, "num_key_value_heads", value.shape[0], config.get("num_attention_heads"))
                value = permute_rotary(value, heads)
            qtype = getattr(gguf.GGMLQuantizationType, qname)
            data = value.to(dtype).contiguous().reshape(-1).view(torch.uint8).numpy()
            writer.add_tensor(f"{gguf_name}.lora_{which.lower()}", data, raw_dtype=qtype,
                              raw_shape=quant_shape_to_byte_shape(tuple(value.shape), qtype))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    return {"bytes": out.stat().st_size, "factors": len(factors), "rank": rank, "alpha": alpha, "base": str(base)}


_LAYER = re.compile(r"\.layers\.(\d+)\.")


def _blocks(config: dict[str, Any], keys: list[str], base: Path) -> int:
    """The layers the adapter's factors name (the largest index, plus one), checked against the base's layer count
    before the GGUF name map is built for them: a crafted count never sizes it."""
    layers = config.get("num_hidden_layers")
    found = [int(m.group(1)) for m in map(_LAYER.search, keys) if m]
    need = max(found) + 1 if found else 1
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < need:
        raise CheckpointError(f"--adapter: the base's config.json ({base}) gives num_hidden_layers "
                              f"{str(layers)[:40]}, but the adapter adapts layer {need - 1}")
    return need


def _factors(keys: list[str], names: Any, where: Path) -> list[tuple[str, str, str, str]]:
    """``(GGUF weight name, key, A or B, module)`` for every LoRA factor, A before B, in the file's order."""
    out = []
    for key in sorted(keys):
        m = _FACTOR.match(key)
        if m is None:
            raise UserError(f"--adapter: {where} holds '{key}', which is not a LoRA factor; export it merged")
        new = names.get_name(m["module"] + ".weight", try_suffixes=(".weight",))
        if new is None:
            raise UserError(f"--adapter: the adapted module '{m['module']}' has no GGUF name; export it merged")
        out.append((new, key, m["which"], m["module"]))
    return sorted(out, key=lambda t: (t[0], t[2]))
