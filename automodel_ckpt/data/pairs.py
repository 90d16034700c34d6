"""Preference pairs: each record's prompt with its chosen and its rejected response, as two aligned sets of rows.

A record is ``prompt``/``chosen``/``rejected`` strings or chats (scored on the last assistant turn), each side
tokenized by the SFT encoder; row ``i`` of each set is one pair, and a batch is the chosen rows then the rejected
rows (one forward for both, as TRL's concatenated forward). Formats: docs/preference.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import datasets
import numpy as np
import torch
from omegaconf import DictConfig

from automodel_ckpt.config.instantiate import instantiate
from automodel_ckpt.data.encode import DataSpec
from automodel_ckpt.data.fields import RecordTemplate
from automodel_ckpt.data.loader import MicroBatch, micro_batch, strided_rows
from automodel_ckpt.data.pipeline import data_spec, pad_token_id, split_rows
from automodel_ckpt.data.stream.corpus import is_streamed
from automodel_ckpt.data.tokenize import (CacheInfo, TokenizedData, build_rows, cache_line, content_hash,
                                          encode_dataset)
from automodel_ckpt.errors import ConfigError

SIDES = ("chosen", "rejected")
#: Bump when the views below change for the same records.
PAIRS_VERSION = "1"


@dataclass(frozen=True)
class PairFields:
    prompt: str = "prompt"
    chosen: str = "chosen"
    rejected: str = "rejected"
    prompt_template: str | None = None  # data.prompt_template: a text pair's prompt rendered from its record's fields

    @classmethod
    def from_section(cls, dpo: Any, prompt_template: str | None = None) -> "PairFields":
        return cls(dpo.prompt_field, dpo.chosen_field, dpo.rejected_field, prompt_template)


def pair_mode(ds: datasets.Dataset, fields: PairFields) -> str:
    """``"chat"`` (message lists) or ``"text"``; a one-line refusal naming the missing column."""
    columns = ds.column_names
    missing = [f"'{name}' (dpo.{key}_field)" for key, name in (("chosen", fields.chosen), ("rejected", fields.rejected))
               if name not in columns]
    chat = not missing and len(ds) > 0 and isinstance(ds[0][fields.chosen], list)
    if chat and fields.prompt_template is not None:
        raise ConfigError("data.prompt_template: it renders the prompt of text pairs; these pairs are chat messages, "
                          "rendered with the chat template (data.chat_template)")
    if not chat and fields.prompt not in columns and fields.prompt_template is None:
        missing.insert(0, f"'{fields.prompt}' (dpo.prompt_field)")
    if missing:
        raise ConfigError(f"dataset: preference records need prompt, chosen and rejected columns; missing "
                          f"{', '.join(missing)}; the records have {', '.join(sorted(columns))}")
    return "chat" if chat else "text"


class _SideView:
    """``datasets.map`` function: one side of each pair as an SFT record (prompt/completion, or messages)."""

    def __init__(self, fields: PairFields, side: str, chat: bool) -> None:
        self.fields, self.side, self.chat = fields, side, chat
        self.template = RecordTemplate(fields.prompt_template, "data.prompt_template") \
            if fields.prompt_template is not None else None

    def __call__(self, batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        responses = batch[getattr(self.fields, self.side)]
        out: dict[str, list] = {}
        if "id" in batch:
            out["id"] = batch["id"]
        if self.chat:
            prompts = batch.get(self.fields.prompt) or [None] * len(responses)
            out["messages"] = [(p if isinstance(p, list) else []) + list(r) for p, r in zip(prompts, responses)]
        else:
            out["prompt"] = self._prompts(batch, indices)
            out["completion"] = [str(r) for r in responses]
        return out

    def _prompts(self, batch: dict[str, list], indices: list[int]) -> list[str]:
        if self.template is None:
            return [str(p) for p in batch[self.fields.prompt]]
        keys = list(batch)
        return [self.template.render({key: batch[key][k] for key in keys}, i) for k, i in enumerate(indices)]


def side_view(ds: datasets.Dataset, fields: PairFields, side: str, mode: str) -> datasets.Dataset:
    named = {k: v for k, v in dataclasses.asdict(fields).items() if k != "prompt_template" or v is not None}
    # without a template: as before it existed
    fingerprint = content_hash(PAIRS_VERSION, ds._fingerprint, named, side, mode)
    return ds.map(_SideView(fields, side, mode == "chat"), batched=True, with_indices=True,
                  remove_columns=ds.column_names,
                  new_fingerprint=fingerprint, keep_in_memory=not ds.cache_files, load_from_cache_file=True,
                  desc=f"{side} responses")


class PairData:
    """Aligned chosen and rejected rows; ``batch(idx)`` gives the chosen rows of ``idx`` then their rejected rows."""

    def __init__(self, chosen: TokenizedData, rejected: TokenizedData) -> None:
        if len(chosen) != len(rejected):
            raise ValueError(f"{len(chosen)} chosen rows but {len(rejected)} rejected rows")
        self.chosen, self.rejected = chosen, rejected
        # a pair is named by its row (the loader's sample ids): unique, and the key of precomputed reference
        # log-probs; the record's own id is ``record_ids``
        self.sample_ids = torch.arange(len(chosen))
        self.record_ids = chosen.sample_ids
        self.caches = chosen.caches + rejected.caches

    def __len__(self) -> int:
        return len(self.chosen)

    @property
    def fingerprint(self) -> str:
        """What the rows are: both sides' row fingerprints (``datasets`` fingerprints, from what made them)."""
        return content_hash(self.chosen.rows._fingerprint, self.rejected.rows._fingerprint, len(self))

    def batch(self, idx: torch.Tensor | list[int]) -> dict[str, torch.Tensor | None]:
        c, r = self.chosen.batch(idx), self.rejected.batch(idx)
        return {"input_ids": torch.cat([c["input_ids"], r["input_ids"]]),
                "labels": torch.cat([c["labels"], r["labels"]]),
                "attention_mask": torch.cat([c["attention_mask"], r["attention_mask"]]), "position_ids": None,
                "pixel_values": None}

    def totals(self) -> dict[str, int]:
        c, r = self.chosen.totals(), self.rejected.totals()
        return {"pairs": len(self), "tokens": c["tokens"] + r["tokens"],
                "scored_tokens": c["trained_tokens"] + r["trained_tokens"],
                "truncated": c["truncated"] + r["truncated"]}

    def check_scored(self, seq_length: int) -> None:
        """Refuse a pair with a side that has no token to score (its prompt fills ``data.seq_length``)."""
        for side in SIDES:
            rows: TokenizedData = getattr(self, side)
            trained = rows.rows.with_format("arrow", columns=["num_trained"])[:]["num_trained"].to_numpy()
            empty = np.flatnonzero(trained == 0)
            if empty.size:
                sample = int(rows.sample_ids[int(empty[0])])
                raise ConfigError(f"dataset: pair {sample} leaves no {side} token to score in data.seq_length "
                                  f"{seq_length} ({empty.size} such pair(s)); raise data.seq_length or shorten "
                                  "the prompt")


@dataclass
class PreparedPairs:
    train: PairData
    validation: PairData | None
    spec: DataSpec
    mode: str
    caches: list[CacheInfo]

    def report(self) -> str:
        t = self.train.totals()
        parts = [f"data: {t['pairs']} training pairs ({self.mode}) -> 2 x {t['pairs']} sequences of "
                 f"{self.spec.seq_length} tokens, {t['tokens']} tokens, {t['scored_tokens']} scored, "
                 f"{t['truncated']} truncated responses"]
        if self.validation is not None:
            parts.append(f"validation {len(self.validation)} pairs")
        return "; ".join([*parts, cache_line(self.caches)])


def pair_spec(cfg: DictConfig) -> DataSpec:
    """The SFT data spec for one side: padded, one example a row; chat scored on the last assistant turn."""
    return dataclasses.replace(data_spec(cfg), packing=False, prompt_field="prompt", completion_field="completion",
                               messages_field="messages", prompt_template=None, completion_template=None,
                               chat_loss="last")


def encode_pairs(ds: datasets.Dataset, tokenizer: Any, spec: DataSpec, fields: PairFields,
                 mode: str | None = None) -> PairData:
    mode = mode or pair_mode(ds, fields)
    pad = pad_token_id(tokenizer)
    sides = []
    for side in SIDES:
        encoded, info = encode_dataset(side_view(ds, fields, side, mode), tokenizer, spec)
        rows = build_rows(encoded, spec, pad)
        rows.caches.insert(0, info)
        sides.append(rows)
    return PairData(*sides)


def prepare_pairs(cfg: DictConfig, tokenizer: Any) -> PreparedPairs:
    """Load, split, tokenize (cached) and check the recipe's preference pairs."""
    if is_streamed(cfg.get("dataset")):
        raise ConfigError("dataset: a streamed corpus holds no preference pairs; DPO reads a map-style dataset of "
                          "prompt, chosen and rejected columns")
    fields = PairFields.from_section(cfg.dpo, cfg.data.prompt_template)
    spec = pair_spec(cfg)
    source: datasets.Dataset = instantiate(cfg.dataset, "dataset")
    mode = pair_mode(source, fields)
    if cfg.validation_dataset is not None:
        train_source, val_source = source, instantiate(cfg.validation_dataset, "validation_dataset")
        pair_mode(val_source, fields)
    else:
        train_source, val_source = split_rows(source, cfg.data.val_size, cfg.seed, key=content_hash(
            source._fingerprint, len(source), cfg.data.val_size, cfg.seed))
    train = encode_pairs(train_source, tokenizer, spec, fields, mode)
    train.check_scored(spec.seq_length)
    val = encode_pairs(val_source, tokenizer, spec, fields, mode) if val_source is not None and len(val_source) \
        else None
    if val is not None:
        val.check_scored(spec.seq_length)
    return PreparedPairs(train, val, spec, mode, train.caches + (val.caches if val is not None else []))


def pair_batches(data: PairData, *, local_batch_size: int, rank: int, world_size: int) -> list[MicroBatch]:
    """Every pair once over all ranks (``strided_rows``), the filling pairs' sample id -1 (left out of sums)."""
    batches = []
    for b, keep in strided_rows(len(data), local_batch_size=local_batch_size, rank=rank, world_size=world_size):
        mb = micro_batch(data, b)
        mb.sample_ids = mb.sample_ids.masked_fill(~keep, -1)
        batches.append(mb)
    return batches
