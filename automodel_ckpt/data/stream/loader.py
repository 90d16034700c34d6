"""The streamed loader: DataLoader workers compute the global stream, each rank keeps its share, the position is global.

Sequences are dealt in groups of ``dp`` (the data-parallel size): global sequence ``k`` goes to data-parallel rank
``k mod dp``. With ``num_workers`` W, worker ``w`` of a rank hands over the groups ``g`` with ``g mod W == w``, and
the DataLoader takes them from its workers in turn, so the rank sees its sequences in order whatever W is. Each
reader computes the whole stream (the order of sequences depends on every document's length) and keeps its own: a
simple, provable design that costs each reader the tokenization of the whole stream (docs/data.md, "Streaming").

At the end of each step's last group, every reader attaches the stream's position; the loader keeps the one of the
step it last handed out. That position is global (the same on every rank) and is what a checkpoint stores: a resume
on any number of ranks and workers starts every reader from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from automodel_ckpt.data.loader import MicroBatch
from automodel_ckpt.data.stream.corpus import Corpus, Shard
from automodel_ckpt.data.stream.order import sequence_id
from automodel_ckpt.data.stream.readers import DataError
from automodel_ckpt.data.stream.stream import GlobalStream, StreamSettings

#: ``steps_per_epoch`` of a streamed loader: a stream has no fixed epoch length (``step_scheduler.max_steps`` ends it).
UNBOUNDED_STEPS = 1 << 40


@dataclass
class _Item:
    tokens: np.ndarray | None
    labels: np.ndarray | None = None
    sequence_id: int = 0
    position: dict[str, Any] | None = None  # the global position after this group, when it ends a step
    error: str | None = None


class _Share(IterableDataset):
    """One rank's sequences from ``position`` on; in a worker, that worker's groups of them."""

    def __init__(self, corpus: Corpus, shards: list[list[Shard]], tokenizer: Any, settings: StreamSettings,
                 position: dict[str, Any] | None, dp_rank: int, dp_size: int, groups_per_step: int) -> None:
        self.args = (corpus, shards, tokenizer, settings, position)
        self.dp_rank, self.dp_size, self.groups_per_step = dp_rank, dp_size, groups_per_step

    def __iter__(self) -> Iterator[_Item]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        try:
            stream = GlobalStream(*self.args)
            g = 0
            while True:
                group = [(stream.next_sequence(), stream.last_labels) for _ in range(self.dp_size)]
                if g % workers == worker:
                    mine, labels = group[self.dp_rank]
                    ends_step = (g + 1) % self.groups_per_step == 0
                    yield _Item(mine, labels, sequence_id(mine), stream.position() if ends_step else None)
                g += 1
        except DataError as exc:  # every reader meets it at the same place: every rank stops at the same step
            yield _Item(None, error=str(exc))


def _quiet_stop_signals(_worker: int) -> None:
    """A DataLoader worker leaves the signals that stop or preempt a run to its rank (a scheduler may send them to
    every process): SIGINT and SIGUSR1/2 are ignored, and SIGTERM (also how the DataLoader ends its workers) ends the
    worker with exit code 0, which the DataLoader does not report as a failure, so the rank's save goes on."""
    import os
    import signal

    for name in ("SIGINT", "SIGUSR1", "SIGUSR2"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))


class StreamLoader:
    """Yields, per optimizer step, this rank's micro-batches of the next global batch of the stream.

    ``state_dict`` is the global position after the last step (the same on every rank, so it is saved once);
    ``load_state_dict`` checks the corpus against the one the position was taken on (``check_corpus``).
    """

    def __init__(self, corpus: Corpus, shards: list[list[Shard]], tokenizer: Any, settings: StreamSettings, *,
                 global_batch_size: int, local_batch_size: int, dp_rank: int, dp_size: int, num_workers: int = 0,
                 allow_appended_shards: bool = False, gather: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.corpus, self.shards, self.tokenizer, self.settings = corpus, shards, tokenizer, settings
        self.global_batch_size, self.local_batch_size = global_batch_size, local_batch_size
        self.dp_rank, self.dp_size, self.num_workers = dp_rank, dp_size, num_workers
        self.allow_appended_shards = allow_appended_shards
        self.gather = gather
        self.grad_accum = global_batch_size // (local_batch_size * dp_size)
        self.steps_per_epoch = UNBOUNDED_STEPS
        self.position: dict[str, Any] | None = None
        self.last_sample_ids: list[int] = []
        self._iter: Iterator[_Item] | None = None

    # ------------------------------------------------------------------------------------------ batches
    def _items(self) -> Iterator[_Item]:
        if self._iter is None:
            shards = self.shards if self.position is None else [
                [Shard(*r) for r in s["shards"]] for s in self.position["sources"]]
            share = _Share(self.corpus, shards, self.tokenizer, self.settings, self.position, self.dp_rank,
                           self.dp_size, self.global_batch_size // self.dp_size)
            workers = self.num_workers
            self._iter = iter(DataLoader(share, batch_size=None, num_workers=workers,
                                         prefetch_factor=4 if workers else None, persistent_workers=False,
                                         worker_init_fn=_quiet_stop_signals if workers else None))
        return self._iter

    def next_batch(self) -> tuple[int, list[MicroBatch]]:
        """``(epoch, micro_batches)`` of the next optimizer step; advances the position."""
        items = self._items()
        taken = []
        for _ in range(self.global_batch_size // self.dp_size):
            item = next(items)
            if item.error is not None:
                raise DataError(item.error)
            taken.append(item)
        assert taken[-1].position is not None
        self.position = taken[-1].position
        rows = torch.from_numpy(np.stack([i.tokens for i in taken]))
        labels = torch.from_numpy(np.stack([i.labels for i in taken]))
        ids = torch.tensor([i.sequence_id for i in taken], dtype=torch.long)
        micro = [MicroBatch(r, y, torch.ones_like(r), s) for r, y, s in zip(
            rows.split(self.local_batch_size), labels.split(self.local_batch_size), ids.split(self.local_batch_size))]
        if self.gather is not None:  # the global batch's sequence ids in global order (sequence k: rank k mod dp)
            full = torch.zeros(len(taken), self.dp_size, dtype=torch.float64)
            full[:, self.dp_rank] = ids.double()
            self.last_sample_ids = [int(x) for x in self.gather(full).reshape(-1).tolist()]
        return self.epoch, micro

    # ---------------------------------------------------------------------------------- what is reported
    @property
    def epoch(self) -> int:
        return int(self.position["epoch"]) if self.position else 0

    @property
    def source_tokens(self) -> list[int]:
        return [int(s["tokens"]) for s in self.position["sources"]] if self.position else [0] * len(self.shards)

    @property
    def skipped_rows(self) -> int:
        return int(self.position["skipped"]) if self.position else 0

    def summary(self) -> dict[str, Any] | None:
        """Where the stream is, for a checkpoint's metadata and ``inspect``: per source the epoch, the shard being
        read (its place in the epoch's order and its path), the next row, the tokens consumed."""
        p = self.position
        if p is None:
            return None
        from automodel_ckpt.data.stream.order import shard_order

        sources = []
        for i, src in enumerate(p["sources"]):
            n, pos = int(src["n"]), min(int(src["pos"]), int(src["n"]) - 1)
            shard = shard_order(n, self.settings.seed, i, int(src["epoch"]), self.settings.shuffle)[pos]
            sources.append({"epoch": int(src["epoch"]), "shard": pos + 1, "shards": n, "path": src["shards"][shard][0],
                            "row": int(src["row"]), "tokens": int(src["tokens"]),
                            "buffered_rows": len(src["buffer_keys"])})
        return {"sequences": int(p["sequences"]), "skipped_rows": int(p["skipped"]), "sources": sources}

    # ------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {"kind": "stream", "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "stream":
            raise DataError("the checkpoint's data position is not a streamed corpus's; resume with the dataset it "
                            "was trained on")
        position = state["position"]
        if position is not None:
            check_position(position, self.settings.shuffle_buffer)
            for i, (saved, now) in enumerate(zip(position["sources"], self.shards)):
                saved["shards"] = check_corpus([Shard(*r) for r in saved["shards"]], now, self.allow_appended_shards,
                                               i if len(self.shards) > 1 else None)
            if len(position["sources"]) != len(self.shards):
                raise DataError(f"dataset: the checkpoint's corpus has {len(position['sources'])} sources, this "
                                f"recipe {len(self.shards)}")
        self.position = position
        self._iter = None


def check_corpus(saved: list[Shard], now: list[Shard], allow_appended: bool,
                 source: int | None = None) -> list[list[Any]]:
    """The shard records to resume with: the checkpoint's, plus (with ``allow_appended``) the shards added since,
    read from the next epoch on. A shard changed or gone, or one added without the override: ``DataError``."""
    where = f"dataset.sources[{source}]" if source is not None else "dataset"
    current = {(s.path, s.first): s for s in now}
    for s in saved:
        c = current.get((s.path, s.first))
        if c is None:
            raise DataError(f"{where}: shard '{s.name}' of the checkpoint's corpus is gone; the corpus is part of "
                            "the run's identity (restore the file, or start a new run)")
        if (c.size, c.version, c.stop) != (s.size, s.version, s.stop):
            raise DataError(f"{where}: shard '{s.name}' changed since the checkpoint (size {s.size} -> {c.size}, "
                            f"version {s.version} -> {c.version}); restore it, or start a new run")
    known = {(s.path, s.first) for s in saved}
    added = [s for s in now if (s.path, s.first) not in known]
    if added and not allow_appended:
        raise DataError(f"{where}: {len(added)} shard(s) added since the checkpoint (first: '{added[0].name}'); "
                        "--data.allow_appended_shards true reads them from the next epoch on")
    return [s.record() for s in [*saved, *added]]


def check_position(p: Any, shuffle_buffer: int) -> None:
    """A position read from a checkpoint (untrusted) has the expected shape and bounds: every count and index that
    drives a read is in range, so a damaged or foreign file cannot make a resume read more than a position may.
    Its file paths are checked against the recipe's own listing (``check_corpus``)."""
    from automodel_ckpt.data.stream.stream import DRAW_BATCH

    def bad(what: str) -> DataError:
        return DataError(f"the checkpoint's data position is malformed ({what}); resume from another checkpoint")

    def ints(values: Any, low: int, high: int, what: str) -> None:
        if not isinstance(values, list) or not all(isinstance(v, int) and low <= v < high for v in values):
            raise bad(what)

    if not isinstance(p, dict) or not isinstance(p.get("sources"), list) or not isinstance(p.get("pending"), list):
        raise bad("not a position")
    ints([p.get(k) for k in ("docs", "offset", "sequences", "skipped", "epoch")], 0, 1 << 62, "counters")
    for src in p["sources"]:
        if not isinstance(src, dict) or not isinstance(src.get("shards"), list) or not src["shards"]:
            raise bad("a source without shards")
        n = len(src["shards"])
        if not all(isinstance(r, list) and len(r) in (3, 5) and isinstance(r[0], str) and isinstance(r[1], int)
                   and all(isinstance(v, int) for v in r[3:]) for r in src["shards"]):
            raise bad("a shard record")
        ints([src.get(k) for k in ("epoch", "key", "row", "seen", "epoch_rows", "taken", "tokens")], 0, 1 << 62,
             "a source's counters")
        ints([src.get("n")], 1, n + 1, "the shards of an epoch")
        ints([src.get("pos")], 0, src["n"] + 1, "the place in the shard order")
        ints(src.get("buffer_shards"), 0, n, "the shuffle buffer")
        ints(src.get("buffer_keys"), 0, 1 << 62, "the shuffle buffer")
        if len(src["buffer_shards"]) != len(src["buffer_keys"]) or len(src["buffer_keys"]) > shuffle_buffer:
            raise bad(f"a shuffle buffer of {len(src['buffer_keys'])} rows, data.shuffle_buffer is {shuffle_buffer}")
    if len(p["pending"]) > DRAW_BATCH + 1:
        raise bad("too many pending documents")
    for d in p["pending"]:
        if not (isinstance(d, list) and len(d) == 4 and all(isinstance(v, int) for v in d)
                and 0 <= d[0] < len(p["sources"]) and 0 <= d[1] < len(p["sources"][d[0]]["shards"]) and d[2] >= 0
                and d[3] >= 0):
            raise bad("a pending document")
