"""Held-out sequences of a streamed validation corpus: its first ``max_sequences``, read in file order."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import torch

from automodel_ckpt.data.loader import MicroBatch
from automodel_ckpt.data.stream.corpus import Corpus
from automodel_ckpt.data.stream.stream import GlobalStream, StreamSettings
from automodel_ckpt.data.tokenize import IGNORE_INDEX

#: Sequences a streamed validation corpus gives when its section does not say (``max_sequences``).
DEFAULT_SEQUENCES = 64


def validation_rows(corpus: Corpus, tokenizer: Any, settings: StreamSettings) -> torch.Tensor:
    """The first ``corpus.max_sequences`` sequences (fewer if one pass over the corpus holds fewer): no shuffle."""
    one_pass = StreamSettings(settings.seq_length, settings.seed, shuffle=False, shuffle_buffer=1,
                              skip_bad_rows=settings.skip_bad_rows, text_field=settings.text_field, one_pass=True)
    stream = GlobalStream(corpus, corpus.list_shards("validation_dataset"), tokenizer, one_pass)
    rows = list(itertools.islice(stream, corpus.max_sequences or DEFAULT_SEQUENCES))
    if not rows:
        return torch.zeros(0, settings.seq_length, dtype=torch.long)
    return torch.from_numpy(np.stack(rows))


def validation_batches(rows: torch.Tensor, *, local_batch_size: int, rank: int, world_size: int) -> list[MicroBatch]:
    """Every row once over all ranks (rank ``r``: rows ``r, r+W, ...``); a rank short of rows gets copies of row 0
    whose labels are all ignored, so every rank runs the same number of forwards."""
    per_rank = -(-len(rows) // world_size)
    idx = torch.arange(rank, len(rows), world_size)
    real = torch.ones(per_rank, dtype=torch.bool)
    real[len(idx):] = False
    idx = torch.cat([idx, torch.zeros(per_rank - len(idx), dtype=torch.long)])
    batches = []
    for b, keep in zip(idx.split(local_batch_size), real.split(local_batch_size)):
        r = rows[b]
        labels = r.clone()
        labels[~keep] = IGNORE_INDEX
        batches.append(MicroBatch(r, labels, torch.ones_like(r), b))
    return batches
