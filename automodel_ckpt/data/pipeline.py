"""From a recipe's dataset sections to training and validation rows, with a one-line report of what was built."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import datasets
from datasets.fingerprint import Hasher
import numpy as np
import torch
from omegaconf import DictConfig

from automodel_ckpt.config.instantiate import instantiate
from automodel_ckpt.data.encode import DataSpec
from automodel_ckpt.data.tokenize import CacheInfo, TokenizedData, build_rows, cache_line, encode_dataset
from automodel_ckpt.errors import ConfigError


def data_spec(cfg: DictConfig) -> DataSpec:
    d = cfg.data
    return DataSpec(
        seq_length=int(d.seq_length), packing=bool(d.packing), prompt_field=d.prompt_field,
        completion_field=d.completion_field, text_field=d.text_field, messages_field=d.messages_field,
        image_field=d.image_field, prompt_template=d.prompt_template, completion_template=d.completion_template,
        chat_loss=d.chat_loss, chat_template=cfg.tokenizer.get("chat_template"), num_proc=d.num_proc,
        map_batch_size=int(d.map_batch_size), cache_dir=d.cache_dir)


def pad_token_id(tokenizer: Any) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)


TRUNCATED_SHARE_WARNING = 0.10  # warn when more than this share of the training examples is cut short
WHOLE_SHARE = 0.95  # the warning names the seq_length that keeps this share of the examples whole


@dataclass
class PreparedData:
    train: TokenizedData
    validation: TokenizedData | None
    spec: DataSpec
    caches: list[CacheInfo]
    warning: str | None = None  # a large share of the examples cut short: what seq_length would keep them whole

    def report(self) -> str:
        """One line: examples, tokens, truncation, packing efficiency, and whether tokenization was cached."""
        t = self.train.totals()
        n = self.spec.seq_length
        eff = t["tokens"] / max(t["rows"] * n, 1)
        parts = [f"data: {t['examples']} training examples -> {t['rows']} sequences of {n} tokens "
                 f"({'packed' if self.spec.packing else 'padded'}, {100 * eff:.1f}% real tokens), "
                 f"{t['tokens']} tokens, {t['trained_tokens']} with loss, {t['truncated']} truncated examples"]
        if self.validation is not None:
            parts.append(f"validation {self.validation.totals()['examples']} examples")
        return "; ".join([*parts, cache_line(self.caches)])


def split_indices(n: int, val_size: float, seed: int) -> tuple[list[int], list[int]]:
    """``(train, validation)`` record indices: a seeded random ``val_size`` fraction (<1) or count (>=1) held out."""
    n_val = int(val_size) if val_size >= 1 else int(round(n * val_size))
    if n_val >= n:
        raise ConfigError(f"data.val_size: {val_size:g} leaves no training data ({n} examples)")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(order[n_val:]), sorted(order[:n_val])


def split_rows(ds: datasets.Dataset, val_size: float, seed: int,
               key: str | None = None) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    """The selections of ``split_indices``, fingerprinted by ``key`` or what decides them (not the lists: slower)."""
    train_idx, val_idx = split_indices(len(ds), val_size, seed)
    fingerprint = key or Hasher.hash((ds._fingerprint, len(ds), val_size, seed))
    val = ds.select(val_idx, new_fingerprint=f"{fingerprint}-val") if val_idx else None
    return ds.select(train_idx, new_fingerprint=f"{fingerprint}-train"), val


def prepare_data(cfg: DictConfig, tokenizer: Any, processor: Any = None) -> PreparedData:
    """Load, tokenize (cached), split and pad or pack the recipe's data (with an image-text ``processor``, images)."""
    spec = data_spec(cfg)
    pad = pad_token_id(tokenizer)
    source: datasets.Dataset = instantiate(cfg.dataset, "dataset")
    encoded, info = encode_dataset(source, tokenizer, spec, processor)
    caches = [info]
    if cfg.validation_dataset is not None:
        val_source = instantiate(cfg.validation_dataset, "validation_dataset")
        val_encoded, val_info = encode_dataset(val_source, tokenizer, spec, processor)
        caches.append(val_info)
        train_encoded = encoded
    else:
        train_encoded, val_encoded = split_rows(encoded, cfg.data.val_size, cfg.seed)
    train = build_rows(train_encoded, spec, pad)
    caches += train.caches
    val = build_rows(val_encoded, spec, pad) if val_encoded is not None and len(val_encoded) else None
    if val is not None:
        caches += val.caches
    prepared = PreparedData(train, val, spec, caches)
    prepared.warning = check_lengths(prepared, train_encoded)
    return prepared


def prompt_columns(cfg: DictConfig, prompt_field: str, answer_field: str, section: str) -> tuple[list[Any], list[str]]:
    """The dataset's prompts and answers, for an algorithm that samples its completions (``section`` names it)."""
    rows = instantiate(cfg.dataset, "dataset")
    for key in (prompt_field, answer_field):
        if key not in rows.column_names:
            raise ConfigError(f"{section}: the dataset has no '{key}' column (it has {rows.column_names})")
    return list(rows[prompt_field]), [str(a) for a in rows[answer_field]]


class NoLossError(ConfigError):
    """``data.seq_length`` leaves no token with a loss: training refuses; ``prepared`` holds the rows as cut."""

    def __init__(self, message: str, prepared: PreparedData) -> None:
        super().__init__(message)
        self.prepared = prepared


def check_lengths(prepared: PreparedData, encoded: datasets.Dataset) -> str | None:
    """Refuse rows with no loss; warn when many examples are cut short (naming the 95th percentile length)."""
    seq_length = prepared.spec.seq_length
    totals = prepared.train.totals()
    if not totals["examples"]:
        return None
    share = totals["truncated"] / totals["examples"]
    if totals["trained_tokens"] and share <= TRUNCATED_SHARE_WARNING:
        return None
    lengths = np.asarray(encoded.with_format("arrow", columns=["num_tokens"])[:]["num_tokens"].to_numpy())
    whole = int(np.ceil(np.quantile(lengths, WHOLE_SHARE))) if lengths.size else seq_length
    if totals["trained_tokens"] == 0:
        raise NoLossError(f"data.seq_length: {seq_length} tokens leave no token with a loss in the "
                          f"{totals['examples']} training examples ({totals['truncated']} cut short); "
                          f"--data.seq_length {whole} keeps {WHOLE_SHARE:.0%} of them whole", prepared)
    if whole > seq_length:
        return (f"data.seq_length {seq_length} cuts {totals['truncated']} of {totals['examples']} training examples "
                f"({share:.0%}) short; --data.seq_length {whole} keeps {WHOLE_SHARE:.0%} of them whole")
    return None
