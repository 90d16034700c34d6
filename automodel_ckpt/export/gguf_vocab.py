"""A Hugging Face tokenizer as GGUF metadata: tokens, their types and scores, merges, special tokens, chat template.

``tokenizer.json`` decides the GGUF tokenizer model, as llama.cpp's converter does: byte-level BPE (GPT-2, Llama 3,
Qwen) is ``gpt2``, with the pre-tokenizer named by its split expression; sentencepiece-style BPE (byte fallback,
``▁``: Llama 2, Mistral) is ``llama``, read by ``gguf``'s ``LlamaHfVocab``; a word-level vocabulary of single
characters is a byte-level BPE with no merges. Special tokens and the chat template come from ``gguf``'s
``SpecialVocab``. Any other tokenizer is refused in one line.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from automodel_ckpt.ondisk import INDEX_FILE_LIMIT, read_json
from automodel_ckpt.errors import CheckpointError, UserError

_TOKENIZER_JSON = "tokenizer.json"
MAX_VOCAB = 1 << 20  # embedding rows written as tokens: 4 times the largest vocabulary published; a crafted shape


def add_vocab(writer: Any, side_dir: Path, n_vocab: int, required: tuple[str, ...] = ()) -> str:
    """Write the tokenizer of ``side_dir`` into ``writer``; returns the GGUF tokenizer model written. ``required``:
    tokens the architecture's loader in llama.cpp looks up by text (a vocabulary without them is refused)."""
    import gguf

    path = side_dir / _TOKENIZER_JSON
    if not path.is_file():
        raise UserError(f"GGUF export needs the model's {_TOKENIZER_JSON} (the tokenizer travels inside a GGUF); "
                        "none is in the checkpoint or folder")
    if n_vocab > MAX_VOCAB:
        raise CheckpointError(f"GGUF export: the model's embedding has {n_vocab} rows, more than the {MAX_VOCAB} "
                              "tokens a vocabulary is written with")
    data = read_json(path, "a tokenizer", INDEX_FILE_LIMIT)  # side_dir: private copies, checked
    model = data.get("model") if isinstance(data, dict) else None
    kind = model.get("type") if isinstance(model, dict) else None
    added = {_token_id(t.get("id"), n_vocab, path): t for t in data.get("added_tokens") or []
             if isinstance(t, dict) and "id" in t}
    if kind in ("BPE", "WordLevel") and not isinstance(model.get("vocab"), dict):
        raise CheckpointError(f"'{path}': the {kind} tokenizer's vocab is not a mapping of tokens to ids")
    if kind == "BPE" and (model.get("byte_fallback") or _uses_metaspace(data)):
        rows = list(gguf.LlamaHfVocab(side_dir).all_tokens())  # (text, score, type) of each token
        tokens, scores, types = ([row[k] for row in rows] for k in range(3))
        _pad(tokens, types, n_vocab, scores)
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_add_space_prefix(_prepends_space(data))
        tokenizer_model = "llama"
    elif kind in ("BPE", "WordLevel"):
        tokens, types = _byte_level_tokens(model["vocab"], added, model.get("unk_token"), kind, path, n_vocab)
        _pad(tokens, types, n_vocab)
        merges = [_merge(m, path) for m in model.get("merges") or []] if kind == "BPE" else []
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(_pre_tokenizer_name(data) if kind == "BPE" else "default")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        if merges:
            writer.add_token_merges(merges)
        else:  # llama.cpp requires the key; the gguf library skips empty lists
            writer.add_key_value(gguf.Keys.Tokenizer.MERGES, [], gguf.GGUFValueType.ARRAY,
                                 sub_type=gguf.GGUFValueType.STRING)
        tokenizer_model = "gpt2"
    else:
        raise UserError(f"GGUF export: the {kind or 'unknown'} tokenizer of {path} is not exported yet (byte-level "
                        "BPE, sentencepiece-style BPE and single-character word-level tokenizers are)")
    names = {t.decode("utf-8", "replace") if isinstance(t, bytes) else t for t in tokens}
    missing = [t for t in required if t not in names]
    if missing:
        raise UserError(f"GGUF export: llama.cpp loads this architecture only with the tokens {', '.join(required)} "
                        f"in its vocabulary; the tokenizer lacks {', '.join(missing)}")
    quiet = logging.getLogger("gguf.vocab")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # its notes on pair templates and the like are not the user's concern
    try:
        special = gguf.SpecialVocab(side_dir, load_merges=False, n_vocab=n_vocab)
    finally:
        quiet.setLevel(level)
    special.add_to_gguf(writer, quiet=True)
    return tokenizer_model


def _merge(value: object, path: Path) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value):
        return " ".join(value)
    raise CheckpointError(f"'{path}': the merge {str(value)[:40]} is neither a string nor a pair of strings")


def _token_id(value: object, n_vocab: int, path: Path) -> int:
    """A token id read from ``tokenizer.json``: a whole number below the embedding's ``n_vocab`` rows, else one
    line naming the file."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < n_vocab:
        raise CheckpointError(f"'{path}': token id {str(value)[:40]} is not a row of the model's embedding (0 to "
                              f"{n_vocab - 1})")
    return value


def _byte_level_tokens(vocab: dict[str, int], added: dict[int, dict[str, Any]], unk: str | None, kind: str,
                       path: Path, n_vocab: int) -> tuple[list[str], list[int]]:
    """Tokens in id order spelled in GPT-2's byte alphabet, and their GGUF types."""
    from gguf import TokenType
    from gguf.vocab import bytes_to_unicode

    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    by_id = {_token_id(i, n_vocab, path): t for t, i in vocab.items()}  # each below the embedding's rows: the loop
    by_id.update({i: str(t.get("content")) for i, t in added.items()})  # below is bounded by the real model
    size = max(by_id) + 1 if by_id else 0
    tokens, types = [], []
    for i in range(size):
        text = by_id.get(i)
        if text is None:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
            continue
        if i in added:
            tokens.append(text)
            types.append(TokenType.CONTROL if added[i].get("special") else TokenType.USER_DEFINED)
            continue
        if kind == "WordLevel":
            if len(text) != 1 and text != unk:
                raise UserError(f"GGUF export: the word-level tokenizer of {path} has the multi-character token "
                                f"{text!r}; only single-character word-level vocabularies are exported")
            text = text if text == unk else "".join(spelling[b] for b in text.encode("utf-8"))
        elif not set(text) <= alphabet:
            raise UserError(f"GGUF export: the BPE tokenizer of {path} is not byte-level (token {text!r})")
        tokens.append(text)
        types.append(TokenType.UNKNOWN if text == unk else TokenType.NORMAL)
    return tokens, types


def _pad(tokens: list[Any], types: list[int], n_vocab: int, scores: list[float] | None = None) -> None:
    """Rows of the embedding past the tokenizer's last token get placeholder tokens, as llama.cpp's converter does."""
    from gguf import TokenType

    if len(tokens) > n_vocab:
        raise UserError(f"GGUF export: the tokenizer has {len(tokens)} tokens but the model's embedding only "
                        f"{n_vocab} rows")
    for i in range(len(tokens), n_vocab):
        tokens.append(f"[PAD{i}]")
        types.append(TokenType.UNUSED)
        if scores is not None:
            scores.append(-1000.0)


def _uses_metaspace(data: dict[str, Any]) -> bool:
    return "Metaspace" in repr(data.get("pre_tokenizer")) or "Metaspace" in repr(data.get("decoder"))


def _prepends_space(data: dict[str, Any]) -> bool:
    text = repr(data.get("normalizer")) + repr(data.get("pre_tokenizer"))
    return "Prepend" in text or "'prepend_scheme': 'first'" in text or "'prepend_scheme': 'always'" in text


def _pre_tokenizer_name(data: dict[str, Any]) -> str:
    """llama.cpp's name of the pre-tokenizer of a byte-level BPE, found from its split expression."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    pre = data.get("pre_tokenizer") or {}
    found = re.findall(r"'Regex': '((?:[^'\\]|\\.)*)'", repr(pre))
    pattern = next((item["pattern"]["Regex"] for item in [pre, *(pre.get("pretokenizers") or [])]
                    if isinstance(item, dict) and isinstance(item.get("pattern"), dict) and "Regex" in item["pattern"]),
                   None)
    if pattern is None:
        return "gpt-2" if "ByteLevel" in repr(pre) and not found else "default"
    preferred = ("llama-bpe", "qwen2", "tekken", "gpt-4o")
    for name in preferred + tuple(GGUF_PRE_TOKENIZER_SPLITS):
        if GGUF_PRE_TOKENIZER_SPLITS.get(name) == pattern:
            return name
    raise UserError("GGUF export: the byte-level tokenizer splits text with an expression llama.cpp does not "
                    "name; it would tokenize differently there")
