"""The preview of a streamed recipe: its first packed sequences in the run's global order, documents split at EOS."""

from __future__ import annotations

import itertools
import sys
from typing import Any, TextIO

import numpy as np
from omegaconf import DictConfig

from automodel_ckpt.data.stream.build import stream_settings, streamed_corpus_of
from automodel_ckpt.data.stream.order import sequence_id
from automodel_ckpt.data.stream.stream import GlobalStream, StreamSettings
from automodel_ckpt.errors import ConfigError


def render_sequence(tokenizer: Any, k: int, tokens: list[int]) -> str:
    """A header line, then each document piece of the sequence on its own line (``+`` where a new one starts)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    pieces, start = [], 0
    for t, tok in enumerate(tokens):
        if tok == eos or t == len(tokens) - 1:
            pieces.append(tokens[start:t + 1])
            start = t + 1
    head = (f"── sequence {k} · id {sequence_id(np.asarray(tokens))} · {len(tokens)} tokens · "
            f"{sum(1 for p in pieces if p and p[-1] == eos)} document end(s)")
    lines = [head]
    for i, piece in enumerate(pieces):
        text = tokenizer.decode(piece, skip_special_tokens=False)
        lines.append(("  + " if i else "    ") + text.replace("\n", "\n    "))
    return "\n".join(lines)


def preview_stream(cfg: DictConfig, tokenizer: Any, *, num: int = 3, split: str = "train",
                   out: TextIO | None = None) -> None:
    """Print the first ``num`` sequences the run trains on (or validates on) and how the corpus is read."""
    out = out or sys.stdout
    section = "dataset" if split == "train" else "validation_dataset"
    if cfg.get(section) is None:
        raise ConfigError("preview: this recipe has no validation_dataset")
    corpus = streamed_corpus_of(cfg, section)
    shards = corpus.list_shards(section)
    settings = stream_settings(cfg)
    if split != "train":
        settings = StreamSettings(settings.seq_length, settings.seed, shuffle=False, shuffle_buffer=1,
                                  skip_bad_rows=settings.skip_bad_rows, text_field=settings.text_field, one_pass=True)
    stream = GlobalStream(corpus, shards, tokenizer, settings)
    rows = [s.tolist() for s in itertools.islice(stream, num)]
    print(f"First {len(rows)} {split} sequences of the stream (the run's global order; every token takes the loss; "
          "documents end with EOS):", file=out)
    for k, tokens in enumerate(rows):
        print(render_sequence(tokenizer, k, tokens), file=out)
    files = sum(len(s) for s in shards)
    print(f"{split}: streamed from {files} files ({sum(x.size for s in shards for x in s) / 2**20:.1f} MiB), "
          f"{len(corpus.sources)} source(s); tokens per source so far {stream.source_tokens()}", file=out)
