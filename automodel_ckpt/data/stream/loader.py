"""The streamed loader: each reader computes only the lanes its sequences come from; the position is per lane.

Global sequence ``k`` is the ``k // lanes``-th sequence of lane ``k mod lanes`` and goes to data-parallel rank
``k mod dp``; a rank's ``j``-th sequence comes from DataLoader worker ``j mod W``. A checkpoint stores, per rank,
each lane's position after the step, keyed by lane (docs/data.md, "The order" and "The position").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from automodel_ckpt.data.loader import MicroBatch
from automodel_ckpt.data.stream.bounds import check_fields
from automodel_ckpt.data.stream.corpus import Corpus, Shard
from automodel_ckpt.data.stream.order import sequence_id, shard_order
from automodel_ckpt.data.stream.position import (LANES_VERSION, check_corpus, check_lane, check_position,
                                                 lane_counts, lanes_mismatch, malformed, old_position_to_lanes)
from automodel_ckpt.data.stream.readers import DataError
from automodel_ckpt.data.stream.slots import arrange, fresh_source, specs
from automodel_ckpt.data.stream.stream import GlobalStream, StreamSettings

__all__ = ["StreamLoader", "check_corpus", "check_position", "lanes_of", "worker_lanes", "UNBOUNDED_STEPS"]

#: The fewest sequences a DataLoader worker sends its rank in one message: the hand-over's cost is per message.
MESSAGE_SEQUENCES = 64
#: ``steps_per_epoch`` of a streamed loader: a stream has no fixed epoch length (``step_scheduler.max_steps`` ends it).
UNBOUNDED_STEPS = 1 << 40


def lanes_of(rank: int, dp: int, lanes: int) -> list[int]:
    """The lanes data-parallel rank ``rank`` of ``dp`` computes: those its sequences ``k = rank (mod dp)`` come from."""
    g = math.gcd(dp, lanes)
    return [lane for lane in range(lanes) if lane % g == rank % g]


def worker_lanes(rank: int, dp: int, worker: int, workers: int, lanes: int) -> list[int]:
    """The lanes worker ``worker`` of rank ``rank`` computes (the rank's ``j``-th sequences, ``j mod workers``)."""
    g = math.gcd(dp * workers, lanes)
    return [lane for lane in range(lanes) if lane % g == (rank + worker * dp) % g]


@dataclass
class _Item:
    tokens: np.ndarray | None
    labels: np.ndarray | None = None
    sequence_id: int = 0
    lanes: dict[int, Any] = field(default_factory=dict)  # lane -> (position, counts) at the step's end, if it moved
    error: str | None = None


class _Share(IterableDataset):
    """One rank's (in a worker, that worker's) sequences from global sequence ``start`` on: one list of ``_Item``
    per step, the last carrying the worker's lanes' positions; ``messages`` sends several steps at once, since the
    hand-over's cost is per message."""

    def __init__(self, corpus: Corpus, shards: list[list[Shard]], tokenizer: Any, settings: StreamSettings,
                 positions: dict[int, dict[str, Any]], start: int, dp_rank: int, dp_size: int, per_step: int,
                 lanes: int, workers: int, steps_per_message: int = 1) -> None:
        self.args = (corpus, shards, tokenizer, settings)
        self.positions, self.start = positions, start
        self.dp_rank, self.dp_size, self.per_step, self.lanes, self.workers = dp_rank, dp_size, per_step, lanes, workers
        self.steps_per_message = steps_per_message

    def messages(self) -> Iterator[list[list[_Item]]]:
        """``steps_per_message`` steps' lists at a time (an error ends a message: the steps before it, then it)."""
        message: list[list[_Item]] = []
        for chunk in self:
            message.append(chunk)
            if len(message) == self.steps_per_message or chunk[0].error is not None:
                yield message
                message = []

    def __iter__(self) -> Iterator[list[_Item]]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        r, dp, L, W = self.dp_rank, self.dp_size, self.lanes, self.workers
        gbs = self.per_step * dp
        try:
            mine = worker_lanes(r, dp, worker, W, L)
            streams = {lane: GlobalStream(*self.args, self.positions.get(lane), lane, L) for lane in mine}
            # the global index of each lane's next sequence (a lane's j-th sequence is k = lane + j * L)
            made = {lane: -(-(self.start - lane) // L) for lane in mine}
            for lane, p in self.positions.items():
                if lane in made and int(p["sequences"]) != made[lane]:
                    raise malformed("a lane's count")

            def advance(lane: int, until: int) -> tuple[np.ndarray, np.ndarray] | None:
                """Lane ``lane`` up to its sequence ``until`` (exclusive), returning its last one."""
                last = None
                while lane + made[lane] * L < until:
                    last = (streams[lane].next_sequence(), streams[lane].last_labels)
                    made[lane] += 1
                return last

            j = worker
            chunk: list[_Item] = []
            sent: dict[int, int] = {}  # lane -> its count at the last position sent (a lane's state moves only with it)
            while True:
                k = self.start + r + j * dp
                lane = k % L
                tokens, labels = advance(lane, k + 1)  # type: ignore[misc]
                chunk.append(_Item(tokens, labels, sequence_id(tokens)))
                end = self.start + ((k - self.start) // gbs + 1) * gbs  # the step's boundary
                if k + W * dp >= end:  # this worker's last sequence of the step: its lanes to the boundary
                    for other in mine:
                        advance(other, end)
                    # the positions of the lanes that moved since the last step (every lane at the first): the
                    # others' are those last sent, and a step's sequences come from few of a worker's many lanes
                    chunk[-1].lanes = {x: (streams[x].position(shards=False), lane_counts(streams[x]))
                                       for x in mine if sent.get(x) != made[x]}
                    sent.update((x, made[x]) for x in chunk[-1].lanes)
                    yield chunk
                    chunk = []
                j += W
        except DataError as exc:  # every reader of the lane meets it at the same place
            yield [_Item(None, error=str(exc))]


class _Messages(IterableDataset):
    """A share's steps, ``steps_per_message`` at a time: what a DataLoader worker sends."""

    def __init__(self, share: _Share) -> None:
        self.share = share

    def __iter__(self) -> Iterator[list[list[_Item]]]:
        return self.share.messages()


def _by_step(messages: Iterator[list[list[_Item]]], workers: int) -> Iterator[list[_Item]]:
    """One list per worker and step again, worker 0 first each step, from the DataLoader's messages."""
    while True:
        batch = [message for _, message in zip(range(workers), messages)]  # (range first: no message lost)
        if not batch:
            return
        for step in range(max(len(m) for m in batch)):
            for message in batch:
                if step < len(message):
                    yield message[step]


def _go_on(position: dict[str, Any], counts: list[int], added: list[list[Shard]],
           repack: bool) -> tuple[dict[str, Any], list[int]]:
    """A lane's position and counts, as new objects, with the stage's new sources and sequence length."""
    position = dict(position, sources=[*position["sources"], *(fresh_source(len(units)) for units in added)])
    if repack:
        position["packed"] = [position["sequences"], sum(int(src["tokens"]) for src in position["sources"])]
    return position, [*counts, *(0 for _ in added)]


def _by_lane(value: Any) -> dict[int, Any]:
    """``{lane: value}`` of a checkpoint's mapping (its keys as written: ints, or their digits after JSON)."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, int) or (isinstance(k, str) and k.isdigit())
                                              for k in value):
        raise malformed("its lanes")
    return {int(k): v for k, v in value.items()}


def _quiet_stop_signals(_worker: int) -> None:
    """A worker leaves stop and preemption signals to its rank: SIGINT and SIGUSR1/2 ignored, SIGTERM (also how the
    DataLoader ends its workers) exits 0, which the DataLoader does not report as a failure."""
    import os
    import signal

    for name in ("SIGINT", "SIGUSR1", "SIGUSR2"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))


class StreamLoader:
    """Per step, this rank's micro-batches of the lanes' interleaving; its state: the positions of its lanes."""

    checkpoint_scope = "rank"

    def __init__(self, corpus: Corpus, shards: list[list[Shard]], tokenizer: Any, settings: StreamSettings, *,
                 global_batch_size: int, local_batch_size: int, dp_rank: int, dp_size: int, num_workers: int = 0,
                 allow_appended_shards: bool = False, lanes: int = 1,
                 gather: Callable[[torch.Tensor], torch.Tensor] | None = None, log_ids: bool = True):
        self.corpus, self.shards, self.tokenizer, self.settings = corpus, shards, tokenizer, settings
        self.stream_corpus = corpus  # the stream's sources by slot (``slots``): the recipe's, and those it dropped
        self.global_batch_size, self.local_batch_size = global_batch_size, local_batch_size
        self.dp_rank, self.dp_size, self.lanes = dp_rank, dp_size, lanes
        self.per_step = global_batch_size // dp_size
        self.num_workers = min(num_workers, self.per_step)  # a worker beyond the rank's sequences per step: idle
        self.allow_appended_shards = allow_appended_shards
        self.gather, self.log_ids = gather, log_ids
        self.grad_accum = global_batch_size // (local_batch_size * dp_size)
        self.steps_per_epoch = UNBOUNDED_STEPS
        self.my_lanes = lanes_of(dp_rank, dp_size, lanes)
        self.sequences = 0  # global sequences handed out (all ranks) after the last step
        self.positions: dict[int, dict[str, Any]] = {}  # lane -> its position after the last step
        self.counts: dict[int, list[int]] = {}  # lane -> [epoch, skipped, tokens per source ...]
        self.totals: list[int] | None = None  # [epoch, skipped, tokens per source ...] over every lane
        self.last_sample_ids: list[int] = []
        self._iter: Iterator[list[_Item]] | None = None
        self._taken = 0  # this rank's sequences handed out since the workers started (the next one's worker)

    @property
    def redundancy(self) -> int:
        """How many data-parallel ranks compute each lane (1: each lane is read once)."""
        return self.dp_size // math.gcd(self.dp_size, self.lanes)

    # ------------------------------------------------------------------------------------------ batches
    def _items(self) -> Iterator[list[_Item]]:
        if self._iter is None:
            self._taken = 0
            workers = self.num_workers
            # a worker's message carries at least MESSAGE_SEQUENCES sequences (its steps in one message)
            steps = -(-MESSAGE_SEQUENCES // -(-self.per_step // workers)) if workers else 1
            share = _Share(self.stream_corpus, self.shards, self.tokenizer, self.settings, self.positions,
                           self.sequences, self.dp_rank, self.dp_size, self.per_step, self.lanes, max(workers, 1),
                           steps)
            self._iter = iter(share) if not workers else _by_step(iter(DataLoader(
                _Messages(share), batch_size=None, num_workers=workers, prefetch_factor=4,
                persistent_workers=False, worker_init_fn=_quiet_stop_signals)), workers)
        return self._iter

    def next_batch(self) -> tuple[int, list[MicroBatch]]:
        """``(epoch, micro_batches)`` of the next optimizer step; advances the position."""
        items = self._items()
        workers = max(self.num_workers, 1)
        if workers == 1:  # (one chunk: the step's sequences in order, its last one carrying the lanes' positions)
            chunk = next(items)
            if len(chunk) == self.per_step and chunk[0].error is None:
                self._taken += self.per_step
                for lane, (position, counts) in chunk[-1].lanes.items():
                    self.positions[lane], self.counts[lane] = position, counts
                return self._deliver(chunk, self._reduce(None))
            chunks = [chunk]
        else:
            chunks = [next(items) for _ in range(workers)]  # one a worker, in the DataLoader's order (worker 0 first)
        error = next((c[0].error for c in chunks if c and c[0].error is not None), None)
        taken: list[_Item] = []
        if error is None:
            dealt = [iter(c) for c in chunks]
            taken = [next(dealt[(self._taken + t) % workers]) for t in range(self.per_step)]  # the j-th: worker j mod W
            self._taken += self.per_step
            for item in taken:
                for lane, (position, counts) in item.lanes.items():
                    self.positions[lane], self.counts[lane] = position, counts
        return self._deliver(taken, self._reduce(error))

    def _deliver(self, taken: list[_Item], error: str | None) -> tuple[int, list[MicroBatch]]:
        """The step's micro-batches of this rank's sequences ``taken`` (or ``error``, met by some rank, raised)."""
        if error is not None:
            self._iter = None
            raise DataError(error)
        self.sequences += self.global_batch_size
        if len(taken) == 1:  # (np.stack of one array costs as much as the rest of a step)
            one = taken[0]
            rows, labels = torch.from_numpy(one.tokens[None]), torch.from_numpy(one.labels[None])
            ids = torch.from_numpy(np.array([one.sequence_id], dtype=np.int64))
        else:
            rows = torch.from_numpy(np.stack([i.tokens for i in taken]))
            labels = torch.from_numpy(np.stack([i.labels for i in taken]))
            ids = torch.from_numpy(np.fromiter((i.sequence_id for i in taken), dtype=np.int64, count=len(taken)))
        if len(taken) == self.local_batch_size:  # one micro-batch
            micro = [MicroBatch(rows, labels, torch.ones_like(rows), ids)]
        else:
            micro = [MicroBatch(r, y, torch.ones_like(r), s) for r, y, s in zip(
                rows.split(self.local_batch_size), labels.split(self.local_batch_size),
                ids.split(self.local_batch_size))]
        if self.log_ids:  # the global batch's sequence ids in global order (sequence k: rank k mod dp)
            full = torch.zeros(len(taken), self.dp_size, dtype=torch.float64)
            full[:, self.dp_rank] = ids.double()
            full = self.gather(full) if self.gather is not None else full
            self.last_sample_ids = [int(x) for x in full.reshape(-1).tolist()]
        return self.epoch, micro

    def _reduce(self, error: str | None) -> str | None:
        """The lanes' counts summed over the ranks; bad data met by one rank stops every rank, with its message."""
        width = 2 + len(self.shards)
        if self.gather is None or self.dp_size == 1:  # this rank's lanes (all of them at dp 1)
            own = list(self.counts.values())
            if len(own) == 1 and len(own[0]) == width:  # (one lane: its counts are the totals)
                self.totals = list(own[0])
                return self._too_many_bad_rows(error)
            self.totals = [min((c[0] for c in own), default=0), *[sum(c[i] for c in own) for i in range(1, width)]]
        else:
            g, end = math.gcd(self.dp_size, self.lanes), self.lanes * width
            flat = [0] * (end + 1)
            for lane, counts in self.counts.items():
                if self.dp_rank == lane % g:
                    flat[lane * width:(lane + 1) * width] = counts
            flat[-1] = 1 if error is not None else 0
            vec = [int(x) for x in self.gather(torch.tensor(flat, dtype=torch.float64)).tolist()]
            self.totals = [min(vec[0:end:width]), *[sum(vec[i:end:width]) for i in range(1, width)]]
            if vec[-1]:  # a rank met bad data: every rank stops, with the first such rank's message
                error = self._first_error(error)
        return self._too_many_bad_rows(error)

    def _too_many_bad_rows(self, error: str | None) -> str | None:
        """``error``, or the message of ``data.skip_bad_rows`` reached by the totals."""
        if error is None and self.totals is not None and self.totals[1] > self.settings.skip_bad_rows:
            error = (f"dataset: {self.totals[1]} bad rows skipped, data.skip_bad_rows ({self.settings.skip_bad_rows}) "
                     "reached")
        return error

    def _first_error(self, error: str | None) -> str:
        """The message of the lowest rank that met bad data, on every rank (a collective: every rank calls it)."""
        assert self.gather is not None
        text = torch.zeros(self.dp_size, 512, dtype=torch.float64)
        if error is not None:
            raw = error.encode("utf-8")[:512]
            text[self.dp_rank, :len(raw)] = torch.tensor(list(raw), dtype=torch.float64)
        first = next(row for row in self.gather(text).long().tolist() if any(row))
        return bytes(b for b in first if b).decode("utf-8", errors="replace")

    # ---------------------------------------------------------------------------------- what is reported
    @property
    def epoch(self) -> int:
        """The epoch every lane has reached (the least of the lanes' epochs of the data trained on)."""
        return self.totals[0] if self.totals else 0

    @property
    def source_tokens(self) -> list[int]:
        return list(self.totals[2:]) if self.totals else [0] * len(self.shards)

    @property
    def skipped_rows(self) -> int:
        return self.totals[1] if self.totals else 0

    def report(self, waited: float) -> dict[str, Any]:
        """A step's record: the tokens each source gave so far, the wait for the batch, the bad rows skipped."""
        skipped = self.skipped_rows
        return {"source_tokens": self.source_tokens, "data_wait_seconds": round(waited, 6)} | (
            {"skipped_rows": skipped} if skipped else {})

    def summary(self) -> dict[str, Any] | None:
        """Where the stream is, for a checkpoint's metadata and ``inspect``."""
        if not self.positions:
            return None
        import pickle

        first = self.positions[min(self.positions)]
        lane = min(self.positions)
        sources = []
        for i, src in enumerate(first["sources"]):
            n, epoch = int(src["n"]), int(src["epoch"])
            whole = shard_order(n, self.settings.seed, i, epoch, self.settings.shuffle)
            order = whole[lane::self.lanes] if n >= self.lanes else [whole[lane % n]]
            pos = min(int(src["pos"]), len(order) - 1)
            sources.append({"epoch": self.epoch, "shard": pos + 1, "shards": len(order),
                            "path": self.shards[i][order[pos]].path if order[pos] < len(self.shards[i]) else "",
                            "row": int(src["row"]), "tokens": self.source_tokens[i],
                            "buffered_rows": sum(len(p["sources"][i]["buffer_keys"]) for p in self.positions.values())})
        return {"sequences": self.sequences, "skipped_rows": self.skipped_rows, "lanes": self.lanes,
                "lanes_read": len(self.my_lanes), "position_bytes": len(pickle.dumps(self.state_dict())),
                "sources": sources}

    def steps_left(self, num_epochs: int) -> int:
        """Unbounded: a stream has no fixed epoch length (``step_scheduler.max_steps`` ends it)."""
        return UNBOUNDED_STEPS

    def begin_stage(self) -> str | None:
        """A new stage (docs/stages.md) goes on from each lane's position: the next sequences of the global order."""
        return None

    # ------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {"kind": "stream", "version": LANES_VERSION, "lanes": self.lanes, "sequences": self.sequences,
                "shards": [[s.record() for s in src] for src in self.shards],
                "source_specs": specs(self.stream_corpus), "seq_length": self.settings.seq_length,
                "positions": {lane: self.positions[lane] for lane in sorted(self.positions)},
                "counts": {lane: self.counts[lane] for lane in sorted(self.counts)}}

    def reshard_state(self, saved: Callable[[int], dict[str, Any]], saved_dp: int, rank: int,
                      dp: int) -> dict[str, Any]:
        """This rank's state from a checkpoint of ``saved_dp`` ranks: each lane from the lowest rank that read it."""
        first = saved(0)
        if first.get("version") != LANES_VERSION:
            return first  # one global position, the same in every file (load_state_dict decides)
        if not first.get("sequences"):
            return first  # saved before the first step: no lane has moved
        lanes = int(first.get("lanes", 0))
        if lanes != self.lanes:
            raise DataError(lanes_mismatch(lanes, self.lanes))
        g = math.gcd(saved_dp, lanes)
        files: dict[int, dict[str, Any]] = {0: first}
        out = dict(first, positions={}, counts={})
        for lane in lanes_of(rank, dp, lanes):
            owner = lane % g
            if owner not in files:
                files[owner] = saved(owner)
            got = files[owner]
            positions, counts = _by_lane(got.get("positions")), _by_lane(got.get("counts"))
            if got.get("sequences") != first.get("sequences") or lane not in positions or lane not in counts:
                raise malformed("a lane missing")
            out["positions"][lane], out["counts"][lane] = positions[lane], counts[lane]
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "stream":
            raise DataError("the checkpoint's data position is not a streamed corpus's; resume with the dataset it "
                            "was trained on")
        if "position" in state:  # one global stream, as written before lanes
            state = old_position_to_lanes(state["position"], self.lanes, self.settings.shuffle_buffer)
            if state is None:
                return
        if state.get("version") != LANES_VERSION:
            raise DataError(f"the checkpoint's data position has version {state.get('version')}, this version reads "
                            f"{LANES_VERSION}")
        if state.get("lanes") != self.lanes:
            raise DataError(lanes_mismatch(state.get("lanes"), self.lanes))
        slots = arrange(self.corpus, self.shards, state.get("shards"), state.get("source_specs"),
                        self.allow_appended_shards)
        saved = slots.shards[:slots.saved]
        sequences = state.get("sequences")
        if not isinstance(sequences, int) or sequences < 0:
            raise malformed("its sequence count")
        packed = state.get("seq_length", self.settings.seq_length)  # the length its lanes packed at
        if not isinstance(packed, int) or isinstance(packed, bool) or packed < 2:
            raise malformed("its sequence length")
        positions, counts = _by_lane(state.get("positions")), _by_lane(state.get("counts"))
        if sequences and any(lane not in positions or lane not in counts for lane in self.my_lanes):
            raise malformed("a lane missing")
        saved_corpus = replace(slots.corpus, sources=slots.corpus.sources[:slots.saved])
        for lane in self.my_lanes:
            if lane in positions:
                check_lane(positions[lane], counts[lane], saved, self.settings.shuffle_buffer // self.lanes or 1,
                           -(-(sequences - lane) // self.lanes))
                check_fields(positions[lane], saved, saved_corpus, packed)
                positions[lane], counts[lane] = _go_on(positions[lane], counts[lane], slots.shards[slots.saved:],
                                                       packed != self.settings.seq_length)
        self.shards, self.stream_corpus = slots.shards, slots.corpus
        self.sequences = sequences
        self.positions = {lane: positions[lane] for lane in self.my_lanes if lane in positions}
        self.counts = {lane: list(counts[lane]) for lane in self.my_lanes if lane in counts}
        self.totals = None
        self._iter = None
