"""Embedded default model: a character-level tokenizer and a tiny Llama base built offline, byte-for-byte reproducibly."""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

__all__ = ["BASE_SEED", "CHARACTERS", "CHAT_TEMPLATE", "SPECIAL_TOKENS", "TINY_LLAMA_CONFIG", "build_tokenizer",
           "ensure_model_folder", "ensure_tiny_base"]

#: Special tokens, in id order: ``<pad>``=0, ``<s>``=1, ``</s>``=2, ``<unk>``=3.
SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<s>", "</s>", "<unk>")

#: Every ordinary character the tokenizer knows, one token each. Anything else maps to ``<unk>``.
CHARACTERS: str = "0123456789abcdefghijklmnopqrstuvwxyz +-*=:?.,"

#: Chat template of the embedded tokenizer (``<s>user: hi assistant: reply</s>``), in :data:`CHARACTERS` only.
CHAT_TEMPLATE: str = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] + ': ' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ ' ' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)

#: Seed of the base model's weight initialisation; part of the base's identity.
BASE_SEED: int = 0

#: Context length of the base model; also the tokenizer's ``model_max_length``.
_MAX_POSITIONS = 64


def _vocab() -> dict[str, int]:
    tokens = list(SPECIAL_TOKENS) + list(CHARACTERS)
    return {token: index for index, token in enumerate(tokens)}


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The character-level tokenizer: one token a character; encoding prepends ``<s>``, never appends ``</s>``."""
    vocab = _vocab()
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # every single character its own word: the word-level model acts as a character-level one (spaces included)
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", vocab["<s>"])])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                        unk_token="<unk>", model_max_length=_MAX_POSITIONS, padding_side="right")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _tiny_llama_config() -> dict[str, Any]:
    vocab = _vocab()
    return {
        "vocab_size": len(vocab), "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": _MAX_POSITIONS,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
        # wider than the usual 0.02: at width 128 that leaves attention almost uniform and the task plateaus long
        "initializer_range": 0.06,
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "use_cache": True,
        "bos_token_id": vocab["<s>"], "eos_token_id": vocab["</s>"], "pad_token_id": vocab["<pad>"],
    }


#: ``LlamaConfig`` keyword arguments of the embedded base model (about 0.6M parameters).
TINY_LLAMA_CONFIG: dict[str, Any] = _tiny_llama_config()


def _deterministic_init(model: torch.nn.Module, seed: int, std: float) -> None:
    """Every parameter from NumPy's PCG64 normal stream, identical on every machine (torch's CPU kernels, vectorised
    per instruction set, differ between CPUs for one seed); norm weights start at one."""
    rng = np.random.Generator(np.random.PCG64(seed))
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                values = rng.standard_normal(size=tuple(param.shape)) * std
                param.copy_(torch.from_numpy(values.astype(np.float32)))


def _shard_limit(model: torch.nn.Module) -> int:
    """A shard size (bytes) just above half of ``model``'s bf16 weights: the greedy sharder writes two files."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return int(math.ceil(total * 0.55))


def _write_base(folder: Path) -> None:
    config = LlamaConfig(**TINY_LLAMA_CONFIG)
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config)
    _deterministic_init(model, seed=BASE_SEED, std=config.initializer_range)
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(folder, max_shard_size=_shard_limit(model))

    shards = sorted(folder.glob("*.safetensors"))
    if len(shards) != 2 or not (folder / "model.safetensors.index.json").is_file():
        raise RuntimeError(f"expected two weight shards and an index in {folder}, found {[p.name for p in shards]}")

    build_tokenizer().save_pretrained(folder)
    name_generic_tokenizer(folder)


def name_generic_tokenizer(folder: Path) -> None:
    """Name the generic fast-tokenizer class in ``folder``'s tokenizer config, for older transformers releases."""
    path = folder / "tokenizer_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"tokenizer_class": "PreTrainedTokenizerFast"},
                               indent=2, sort_keys=True) + "\n")


def ensure_tiny_base(path: str | os.PathLike[str]) -> Path:
    """``path`` holding the embedded base model, created if absent (the same bytes on every machine)."""
    return ensure_model_folder(path, _write_base)


def ensure_model_folder(path: str | os.PathLike[str], write: Callable[[Path], None]) -> Path:
    """``path`` holding a model folder, written by ``write(folder)`` into a temporary sibling and renamed into place:
    an existing model folder is kept, an empty folder filled, anything else refused; a lost race uses the winner's."""
    target = Path(path)
    if (target / "config.json").is_file():
        return target
    if target.exists() and not (target.is_dir() and not any(target.iterdir())):
        raise FileExistsError(f"{target} exists but is not a model folder; refusing to overwrite it")

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    staging.chmod(0o755)  # mkdtemp makes it owner-only; the model folder should be shareable
    try:
        write(staging)
        for file in staging.iterdir():
            file.chmod(0o644)
        try:
            os.rename(staging, target)
        except OSError:  # lost the race: another process renamed its folder into place first
            if not (target / "config.json").is_file():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target
