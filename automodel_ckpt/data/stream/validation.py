"""Held-out sequences of a streamed validation corpus: its first ``max_sequences``, read in file order."""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from automodel_ckpt.data.loader import MicroBatch, strided_rows
from automodel_ckpt.data.stream.corpus import Corpus
from automodel_ckpt.data.stream.stream import GlobalStream, StreamSettings
from automodel_ckpt.data.tokenize import IGNORE_INDEX

#: Sequences a streamed validation corpus gives when its section does not say (``max_sequences``).
DEFAULT_SEQUENCES = 64


def one_pass(settings: StreamSettings) -> StreamSettings:
    """``settings`` for reading a corpus once, in file order (validation, previews of it)."""
    return replace(settings, shuffle=False, shuffle_buffer=1, one_pass=True)


def validation_rows(corpus: Corpus, tokenizer: Any, settings: StreamSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, labels)`` of the first ``corpus.max_sequences`` sequences of one pass, unshuffled."""
    stream = GlobalStream(corpus, corpus.list_shards("validation_dataset"), tokenizer, one_pass(settings))
    read = [(t, stream.last_labels) for t in itertools.islice(stream, corpus.max_sequences or DEFAULT_SEQUENCES)]
    if not read:
        empty = torch.zeros(0, settings.seq_length, dtype=torch.long)
        return empty, empty
    return torch.from_numpy(np.stack([t for t, _ in read])), torch.from_numpy(np.stack([y for _, y in read]))


def validation_batches(rows: torch.Tensor, row_labels: torch.Tensor, *, local_batch_size: int, rank: int,
                       world_size: int) -> list[MicroBatch]:
    """Every row once over all ranks (``strided_rows``), filling rows' labels all ignored."""
    batches = []
    for b, keep in strided_rows(len(rows), local_batch_size=local_batch_size, rank=rank, world_size=world_size):
        r = rows[b]
        labels = row_labels[b].clone()
        labels[~keep] = IGNORE_INDEX
        batches.append(MicroBatch(r, labels, torch.ones_like(r), b))
    return batches
