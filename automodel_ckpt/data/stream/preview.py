"""The preview of a streamed recipe: its first packed sequences in the run's global order, documents split at EOS."""

from __future__ import annotations

import itertools
import sys
from typing import Any, TextIO

import numpy as np
from omegaconf import DictConfig

from automodel_ckpt.data.encode import IGNORE_INDEX
from automodel_ckpt.data.preview import CLOSE, OPEN, _segments
from automodel_ckpt.data.stream.build import build_streamed, stream_settings, streamed_corpus_of
from automodel_ckpt.data.stream.order import sequence_id
from automodel_ckpt.data.stream.stream import GlobalStream
from automodel_ckpt.data.stream.validation import one_pass
from automodel_ckpt.errors import ConfigError


def render_sequence(tokenizer: Any, k: int, tokens: list[int], labels: list[int]) -> str:
    """A header, then each document piece on its own line (``+``: a new one), the text with a loss marked « »."""
    eos = getattr(tokenizer, "eos_token_id", None)
    pieces, start = [], 0
    for t, tok in enumerate(tokens):
        if tok == eos or t == len(tokens) - 1:
            pieces.append((start, t + 1))
            start = t + 1
    trained = [y != IGNORE_INDEX for y in labels]
    head = (f"── sequence {k} · id {sequence_id(np.asarray(tokens))} · {len(tokens)} tokens · "
            f"{sum(trained[1:])} with loss · {sum(1 for a, b in pieces if tokens[b - 1] == eos)} document end(s)")
    lines = [head]
    for i, (a, b) in enumerate(pieces):
        text = "".join(f"{OPEN}{piece}{CLOSE}" if on else piece
                       for piece, on in _segments(tokenizer, tokens[a:b], trained[a:b]))
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
        settings = one_pass(settings)
    stream = GlobalStream(corpus, shards, tokenizer, settings)
    rows = [(tokens.tolist(), stream.last_labels.tolist()) for tokens in itertools.islice(stream, num)]
    print(f"First {len(rows)} {split} sequences of the stream (the run's global order; text with loss is "
          f"{OPEN}marked{CLOSE}; documents end with EOS):", file=out)
    for k, (tokens, labels) in enumerate(rows):
        print(render_sequence(tokenizer, k, tokens, labels), file=out)
    files = sum(len(s) for s in shards)
    print(f"{split}: streamed from {files} files ({sum(x.size for s in shards for x in s) / 2**20:.1f} MiB), "
          f"{len(corpus.sources)} source(s); tokens per source so far {stream.source_tokens()}", file=out)


def first_ids(cfg: DictConfig, tokenizer: Any, *, rank: int, world_size: int, num: int) -> list[int]:
    """Data-parallel rank ``rank``'s first ``num`` sequence ids, as its training loader makes them."""
    from types import SimpleNamespace

    if not 0 <= rank < world_size:
        raise ConfigError(f"preview: --rank must be in 0..{world_size - 1}, got {rank}")
    if cfg.step_scheduler.global_batch_size % world_size:
        raise ConfigError(f"preview: step_scheduler.global_batch_size ({cfg.step_scheduler.global_batch_size}) is not "
                          f"a multiple of --world-size {world_size}")
    dims = SimpleNamespace(dp_rank=rank, dp_size=world_size, sum_over_dp=lambda t: t)
    loader, _ = build_streamed(cfg, tokenizer, dims, log_ids=False)
    loader.local_batch_size = loader.per_step  # one micro-batch per step: the grad-accum split does not matter here
    ids: list[int] = []
    while len(ids) < num:
        _, micro = loader.next_batch()
        ids.extend(int(x) for mb in micro for x in mb.sample_ids.tolist())
    return ids[:num]
