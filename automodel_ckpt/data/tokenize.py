"""Tokenization through ``datasets.map`` (batched, parallel, cached by fingerprint) into fixed-length rows."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch

from automodel_ckpt.data.encode import IGNORE_INDEX, DataSpec, Encoder
from automodel_ckpt.data.packing import RowBuilder
from automodel_ckpt.errors import ConfigError

__all__ = ["IGNORE_INDEX", "DataSpec", "TokenizedData", "encode_dataset", "build_rows", "tokenizer_fingerprint"]

logger = logging.getLogger(__name__)

#: Bump when the encoding or row layout changes, so old cache files are not reused.
CACHE_VERSION = "1"


@dataclass
class CacheInfo:
    """Where a ``map`` result lives and whether this call computed it or found it."""

    path: Path | None
    hit: bool
    seconds: float


def cache_line(caches: list[CacheInfo]) -> str:
    """A data report's part on tokenization: in memory, loaded from the cache, or tokenized and cached."""
    files = [c for c in caches if c.path is not None]
    if not files:
        return f"tokenized in memory in {sum(c.seconds for c in caches):.1f}s"
    if all(c.hit for c in files):
        return f"tokenization cached (loaded {files[0].path.parent})"
    return f"tokenized in {sum(c.seconds for c in caches):.1f}s, cached in {files[0].path.parent}"


@dataclass
class TokenizedData:
    """Rows of ``seq_length`` tokens memory-mapped from Arrow, read on demand; ``sample_ids``: each row's example."""

    rows: datasets.Dataset
    caches: list[CacheInfo] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._np = self.rows.with_format("numpy")
        self.sample_ids = torch.from_numpy(_column(self.rows, "sample_id").astype(np.int64))
        self.packed = "position_ids" in self.rows.column_names
        self.has_images = "pixel_values" in self.rows.column_names

    def __len__(self) -> int:
        return len(self.rows)

    def batch(self, idx: torch.Tensor | list[int]) -> dict[str, torch.Tensor | None]:
        index = idx.tolist() if isinstance(idx, torch.Tensor) else list(idx)
        cols = ["input_ids", "labels", "length"] + (["position_ids"] if self.packed else []) \
            + (["pixel_values"] if self.has_images else [])
        got = self._np.select_columns(cols)[index] if index else None
        if got is None:
            n = self.rows.features["input_ids"].length
            empty = torch.zeros((0, n), dtype=torch.long)
            return {"input_ids": empty, "labels": empty, "attention_mask": empty, "position_ids": None,
                    "pixel_values": None}
        ids = torch.from_numpy(np.asarray(got["input_ids"], dtype=np.int64))
        lengths = torch.from_numpy(np.asarray(got["length"], dtype=np.int64))
        mask = (torch.arange(ids.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)).long()
        positions = torch.from_numpy(np.asarray(got["position_ids"], dtype=np.int64)) if self.packed else None
        pixels = torch.from_numpy(np.asarray(got["pixel_values"], dtype=np.float32)) if self.has_images else None
        return {"input_ids": ids, "labels": torch.from_numpy(np.asarray(got["labels"], dtype=np.int64)),
                "attention_mask": mask, "position_ids": positions, "pixel_values": pixels}

    # Whole-set tensors, for small sets and tests.
    @property
    def input_ids(self) -> torch.Tensor:
        return self.batch(range(len(self)))["input_ids"]

    @property
    def labels(self) -> torch.Tensor:
        return self.batch(range(len(self)))["labels"]

    @property
    def attention_mask(self) -> torch.Tensor:
        return self.batch(range(len(self)))["attention_mask"]

    def totals(self) -> dict[str, int]:
        """Examples, rows, real tokens, trained tokens and truncated examples over the whole set."""
        sums = {c: int(_column(self.rows, c).sum()) for c in ("length", "num_examples", "num_truncated", "num_trained")}
        return {"examples": sums["num_examples"], "rows": len(self), "tokens": sums["length"],
                "trained_tokens": sums["num_trained"], "truncated": sums["num_truncated"]}


def _column(ds: datasets.Dataset, name: str) -> np.ndarray:
    """One scalar column as a NumPy array, read in one piece from Arrow."""
    return ds.with_format("arrow", columns=[name])[:][name].to_numpy()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A stable hash of what the tokenizer does: its vocabulary and rules, special tokens and chat template."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        from datasets.fingerprint import Hasher

        h.update(Hasher.hash(tokenizer).encode())
    h.update(json.dumps([type(tokenizer).__name__, tokenizer.special_tokens_map, tokenizer.bos_token_id,
                         tokenizer.eos_token_id, getattr(tokenizer, "chat_template", None)],
                        sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


def content_hash(*parts: Any) -> str:
    """A short SHA-256 of ``parts`` as JSON: a cache file's fingerprint, from what decides its content."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _cache_dir(ds: datasets.Dataset, spec: DataSpec) -> Path | None:
    """``data.cache_dir``, else beside the dataset's own Arrow cache; None for an in-memory dataset."""
    if spec.cache_dir:
        return Path(spec.cache_dir).expanduser()
    if ds.cache_files:
        return Path(ds.cache_files[0]["filename"]).parent
    return None


def _cached_map(ds: datasets.Dataset, fn: Any, *, name: str, fingerprint: str, spec: DataSpec,
                features: datasets.Features, **kwargs: Any) -> tuple[datasets.Dataset, CacheInfo]:
    folder = _cache_dir(ds, spec)
    path = folder / f"{name}-{fingerprint}.arrow" if folder is not None else None
    hit = path is not None and (path.exists() or any(folder.glob(f"{name}-{fingerprint}_*_of_*.arrow")))
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    num_proc = spec.num_proc if spec.num_proc and spec.num_proc > 1 and len(ds) > 1 else None
    out = ds.map(fn, batched=True, batch_size=spec.map_batch_size, num_proc=num_proc, remove_columns=ds.column_names,
                 features=features, new_fingerprint=fingerprint, load_from_cache_file=True,
                 cache_file_name=str(path) if path is not None else None, keep_in_memory=path is None,
                 desc=f"{name} ({len(ds)} records)", **kwargs)
    info = CacheInfo(path, hit, time.perf_counter() - t0)
    logger.info("%s: %s %s in %.1fs", name, "loaded from cache" if hit else "computed", path or "(in memory)",
                info.seconds)
    return out, info


def encode_dataset(ds: datasets.Dataset, tokenizer: Any, spec: DataSpec,
                   processor: Any = None) -> tuple[datasets.Dataset, CacheInfo]:
    """One tokenized example per record (with an image-text ``processor``, its image's ``pixel_values`` too)."""
    mode = spec.mode(ds.column_names)
    images = None
    if processor is not None and spec.image_field in ds.column_names:
        from automodel_ckpt.data.images import ImageChatEncoder, image_spec

        if mode != "chat":
            raise ConfigError(f"dataset: image records need a '{spec.messages_field}' column (image + messages)")
        if spec.packing:
            raise ConfigError("data.packing: image records are padded one per sequence; set data.packing: false")
        images = image_spec(processor)
        encoder: Any = ImageChatEncoder(tokenizer, spec, processor, images)
        features = ImageChatEncoder.features(images)
    else:
        encoder = Encoder(tokenizer, spec, mode)
        features = datasets.Features({
            "input_ids": datasets.List(datasets.Value("int32")), "labels": datasets.List(datasets.Value("int32")),
            "sample_id": datasets.Value("int64"), "num_tokens": datasets.Value("int32"),
        })
    fp = content_hash(CACHE_VERSION, "encode", ds._fingerprint, tokenizer_fingerprint(tokenizer), mode, spec.seq_length,
               spec.prompt_field, spec.completion_field, spec.text_field, spec.messages_field, spec.prompt_template,
               spec.completion_template, spec.chat_loss, spec.chat_template,
               *([spec.image_field, images.fingerprint] if images is not None else []))
    return _cached_map(ds, encoder, name="tokenized", fingerprint=fp, spec=spec, features=features, with_indices=True)


def build_rows(encoded: datasets.Dataset, spec: DataSpec, pad_id: int) -> TokenizedData:
    """Pad or pack encoded examples into rows of ``spec.seq_length`` tokens (cached like the encoding)."""
    n = spec.seq_length
    seq = datasets.List(datasets.Value("int32"), length=n)
    cols = {"input_ids": seq, "labels": seq, "length": datasets.Value("int32"), "sample_id": datasets.Value("int64"),
            "num_examples": datasets.Value("int32"), "num_truncated": datasets.Value("int32"),
            "num_trained": datasets.Value("int32")}
    if spec.packing:
        cols["position_ids"] = seq
    if "pixel_values" in encoded.column_names:  # image records: one per row, the pixels carried along
        cols["pixel_values"] = encoded.features["pixel_values"]
    # Packing fills rows within each map batch (and process), so those settings shape the rows too.
    fp = content_hash(CACHE_VERSION, "rows", encoded._fingerprint, n, spec.packing, pad_id,
               (spec.map_batch_size, spec.num_proc) if spec.packing else None)
    rows, info = _cached_map(encoded, RowBuilder(n, spec.packing, pad_id), name="rows", fingerprint=fp, spec=spec,
                             features=datasets.Features(cols))
    return TokenizedData(rows, [info])
