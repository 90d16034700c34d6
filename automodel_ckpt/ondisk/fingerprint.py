"""What a checkpoint is a checkpoint of: the run fingerprint recorded in metadata.json and compared on resume.

What is recorded, and what is left out so that it may change between runs: docs/checkpointing.md."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from automodel_ckpt.redact import redacted

_FINGERPRINT_VERSION = 1

#: The recipe keys a new stage of a run may change (docs/stages.md); a rerun that changes one resumes only as one.
STAGE_KEYS = frozenset({"dataset", "data.seq_length", "step_scheduler.global_batch_size"})

# Config keys that never change what the saved weights mean.
_CONFIG_IGNORED = frozenset({
    "architectures", "attn_implementation", "dtype", "torch_dtype", "transformers_version", "use_cache",
    "return_dict", "output_attentions", "output_hidden_states", "chunk_size_feed_forward", "problem_type",
    "tokenizer_class", "use_return_dict", "pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id",
    "decoder_start_token_id", "id2label", "label2id",
})


def run_fingerprint(model: Any, tokenizer: Any = None, peft: dict[str, Any] | None = None,
                    recipe: dict[str, Any] | None = None) -> dict[str, Any]:
    """The fingerprint of a run that trains ``model`` (before or after sharding: the same)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {
        "version": _FINGERPRINT_VERSION,
        "model_class": type(base).__name__,
        "config": _architecture(getattr(base, "config", None)),
        "parameters": {name: list(p.shape) for name, p in model.named_parameters()},
        "tokenizer": _vocabulary(tokenizer),
        "peft": _plain(peft),
        "recipe": _plain(redacted(recipe or {})),
    }


def _architecture(config: Any) -> dict[str, Any]:
    """The config keys that define the weights: ``config.to_dict()`` without private and runtime keys."""
    if config is None:
        return {}
    raw = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    return {k: _plain(v) for k, v in sorted(raw.items()) if not k.startswith("_") and k not in _CONFIG_IGNORED}


def _vocabulary(tokenizer: Any) -> dict[str, Any] | None:
    """Size and a SHA-256 of the tokenizer's vocabulary (token → id), or None without a tokenizer."""
    if tokenizer is None or not hasattr(tokenizer, "get_vocab"):
        return None
    vocab = tokenizer.get_vocab()
    digest = hashlib.sha256(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode()).hexdigest()
    return {"size": len(vocab), "sha256": digest}


def first_difference(saved: dict[str, Any] | None, current: dict[str, Any] | None,
                     free: frozenset[str] = frozenset()) -> str | None:
    """How ``current`` differs from ``saved``, in words (the first differing part and its keys); None when they
    match or either is unknown. Recipe keys in ``free`` (a new stage's, ``STAGE_KEYS``) may differ."""
    if not saved or not current or saved.get("version") != current.get("version"):
        return None
    if saved.get("model_class") != current.get("model_class"):
        return f"the model class is {saved.get('model_class')} there, {current.get('model_class')} here"
    diff = _dict_difference("model config", saved.get("config") or {}, current.get("config") or {})
    if diff:
        return diff
    saved_params, params = saved.get("parameters") or {}, current.get("parameters") or {}
    for name in saved_params:
        if name not in params:
            return f"parameter '{name}' exists there, not here"
        if list(saved_params[name]) != list(params[name]):
            return f"parameter '{name}' has shape {tuple(saved_params[name])} there, {tuple(params[name])} here"
    for name in params:
        if name not in saved_params:
            return f"parameter '{name}' exists here, not there"
    if saved.get("tokenizer") and current.get("tokenizer") and saved["tokenizer"] != current["tokenizer"]:
        s, c = saved["tokenizer"], current["tokenizer"]
        sizes = f" ({s['size']} tokens there, {c['size']} here)" if s.get("size") != c.get("size") else ""
        return f"the tokenizer's vocabulary differs{sizes}"
    if (saved.get("peft") is None) != (current.get("peft") is None):
        return "LoRA (peft:) is " + ("on there, off here" if saved.get("peft") is not None else "off there, on here")
    diff = _dict_difference("peft", saved.get("peft") or {}, current.get("peft") or {})
    if diff:
        return diff
    # redacted on both sides: a checkpoint written before redaction may hold a credential in clear
    kept = [{k: v for k, v in redacted(fp.get("recipe") or {}).items() if k not in free} for fp in (saved, current)]
    return _dict_difference("recipe", *kept)


def _dict_difference(what: str, saved: dict[str, Any], current: dict[str, Any], shown: int = 3) -> str | None:
    """How ``current`` differs from ``saved``, key by key (the first ``shown`` keys in sorted order), in words."""
    found = []
    for key in sorted(set(saved) | set(current)):
        if key not in current:
            found.append(f"'{key}' is {_show(saved[key])} there and unset here")
        elif key not in saved:
            found.append(f"'{key}' is unset there and {_show(current[key])} here")
        elif saved[key] != current[key]:
            found.append(f"'{key}' is {_show(saved[key])} there, {_show(current[key])} here")
    if not found:
        return None
    if len(found) == 1:
        return f"{what} key {found[0]}"
    more = f" and {len(found) - shown} more" if len(found) > shown else ""
    return f"{what} keys differ: {'; '.join(found[:shown])}{more}"


def _show(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def _plain(value: Any) -> Any:
    """JSON-shaped copy (what metadata.json will hold), so a saved and a current fingerprint compare equal."""
    return json.loads(json.dumps(value, default=str, sort_keys=True))
