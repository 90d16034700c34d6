"""One lane of a streamed corpus: its packed sequences and its position (small, exact).

Lane ``l`` reads the units ``i`` of each epoch's seeded unit order with ``i mod lanes == l``, through its own
shuffle buffer, blend draws and packing, seeded by ``(seed, lane)``; one lane is the corpus's one global stream. Its
position holds row references, not rows, so a resume reads back only those (docs/data.md, "The position").
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Iterator

import numpy as np

from automodel_ckpt.data.encode import BadRecord, DataSpec, RecordEncoder
from automodel_ckpt.data.stream import order
from automodel_ckpt.data.stream.corpus import Corpus, Shard, file_format
from automodel_ckpt.data.stream.bounds import COUNTERS, check_carry, check_restored, doc_ref
from automodel_ckpt.data.stream.readers import MAX_RECORD_BYTES, DataError, Row, fetch_rows, line_start, read_rows

#: Documents drawn and tokenized together (one tokenizer call): the pending documents a position lists.
DRAW_BATCH = 64
#: Documents a lane of several draws together: its pending references stay few whatever the lane count.
LANE_DRAW_BATCH = 16
#: Version of the position's layout: a checkpoint with another one is refused (not misread).
POSITION_VERSION = 2


@dataclass
class StreamSettings:
    """The ``data:`` keys a stream reads (with the corpus and the tokenizer, all it depends on)."""

    seq_length: int
    seed: int
    shuffle: bool = True
    shuffle_buffer: int = 1000
    skip_bad_rows: int = 0
    text_field: str = "text"
    one_pass: bool = False  # validation: stop at the end of the first epoch instead of starting the next
    spec: DataSpec | None = None  # how records render (templates, chat, fields); None: plain text in text_field
    max_record_bytes: int = MAX_RECORD_BYTES  # a longer line or row is a bad row


class _End(Exception):
    """A one-pass stream reached the end of its corpus."""


class _EpochEnd(Exception):
    """A source's epoch has no row left to read (its shuffle buffer may still hold some)."""


@dataclass
class _Doc:
    source: int
    shard: int
    key: int
    record: dict[str, Any]
    tokens: list[int] | None = None
    labels: list[int] | None = None
    epoch: int = 0  # the epoch of its source it was read in


@dataclass
class _Source:
    """One source's reading position and shuffle buffer (the in-memory side of its part of the position)."""

    index: int
    shards: list[Shard]
    fmt: list[str]
    epoch: int = 0
    n: int = 0  # shards read in this epoch (the list's length when the epoch began)
    pos: int = 0  # index into this epoch's shard order
    key: int = 0  # the next row of the current shard
    row: int = 0
    seen: int = 0  # rows (good or bad) met in the current shard
    epoch_rows: int = 0  # good rows met in this epoch
    taken: int = 0
    tokens: int = 0
    buffer: list[_Doc] = field(default_factory=list)
    rows: Iterator[Row] | None = None
    order_cache: tuple[int, int, list[int]] | None = None

    def record(self, shards: bool = True) -> dict[str, Any]:
        listed = {"shards": [s.record() for s in self.shards]} if shards else {}
        return {**listed, **{k: getattr(self, k) for k in COUNTERS},
                "buffer_shards": [d.shard for d in self.buffer], "buffer_keys": [d.key for d in self.buffer]}


class GlobalStream:
    """``next_sequence()``: the next ``seq_length`` tokens of lane ``lane`` of ``lanes``; ``position()``."""

    def __init__(self, corpus: Corpus, shards: list[list[Shard]], tokenizer: Any, settings: StreamSettings,
                 position: dict[str, Any] | None = None, lane: int = 0, lanes: int = 1) -> None:
        self.corpus, self.tokenizer, self.settings = corpus, tokenizer, settings
        self.lane, self.lanes = lane, lanes
        self.seed = settings.seed if lanes == 1 else order.mix64(settings.seed, 0x1A7E, lanes, lane)
        self.draw_batch = DRAW_BATCH if lanes == 1 else LANE_DRAW_BATCH
        self.empty_units = 0  # units in a row that gave this lane no row (a corpus with none at all: an error)
        self.text_field = corpus.text_field or settings.text_field
        spec = settings.spec or DataSpec(seq_length=settings.seq_length, text_field=self.text_field)
        self.encoder = RecordEncoder(tokenizer, replace(spec, text_field=self.text_field))
        self.last_labels: np.ndarray | None = None  # the loss labels of the last sequence
        self.weights = [s.weight for s in corpus.sources]
        self.buffer_size = max(int(settings.shuffle_buffer) // lanes, 1) if settings.shuffle else 1
        self.sources = [_Source(i, list(s), [file_format(x.path, corpus.sources[i].format) for x in s], n=len(s))
                        for i, s in enumerate(shards)]
        self.docs = 0
        self.pending: deque[_Doc] = deque()
        self.offset = 0
        self.sequences = 0
        self.packed = (0, 0)  # the sequences and tokens made when it began packing at this length (a stage's)
        self.skipped = 0
        self.trained_epoch = 0  # the epoch of the document that ended the last sequence
        self.last_skip: str | None = None
        if position is not None:
            self._restore(position)

    # ------------------------------------------------------------------------------------------ position
    def position(self, shards: bool = True) -> dict[str, Any]:
        """The position after the last sequence made, in plain ints, strings and lists (``shards``: the unit list)."""
        sources = [s.record(shards) for s in self.sources]
        packed = {"packed": list(self.packed)} if self.packed != (0, 0) else {}
        return {"version": POSITION_VERSION, "sources": sources, "docs": self.docs,
                "pending": [[d.source, d.shard, d.key, d.epoch] for d in self.pending], "offset": self.offset,
                "sequences": self.sequences, "skipped": self.skipped, "epoch": self.trained_epoch, **packed}

    def _restore(self, p: dict[str, Any]) -> None:
        if p.get("version") != POSITION_VERSION:
            raise DataError(f"the checkpoint's data position has version {p.get('version')}, this version reads "
                            f"{POSITION_VERSION}")
        wanted: dict[tuple[int, int], set[int]] = {}
        for src, rec in zip(self.sources, p["sources"]):
            if "shards" in rec:
                src.shards = [Shard(*r) for r in rec["shards"]]
                src.fmt = [file_format(x.path, self.corpus.sources[src.index].format) for x in src.shards]
            for name in COUNTERS:
                setattr(src, name, int(rec[name]))
            src.buffer = [_Doc(src.index, int(sh), int(k), {}) for sh, k in zip(rec["buffer_shards"], rec["buffer_keys"])]
            for d in src.buffer:
                wanted.setdefault((src.index, d.shard), set()).add(d.key)
        self.pending = deque(_Doc(int(s), int(sh), int(k), {}, epoch=int(e)) for s, sh, k, e in p["pending"])
        for d in self.pending:
            wanted.setdefault((d.source, d.shard), set()).add(d.key)
        self.docs, self.offset = int(p["docs"]), int(p["offset"])
        self.sequences, self.skipped = int(p["sequences"]), int(p["skipped"])
        self.packed = tuple(int(v) for v in p.get("packed", (0, 0)))
        self.trained_epoch = int(p["epoch"])
        check_restored(self)  # every field against the corpus's files and the stream's counts, before a read
        texts = {}
        for (s, sh), keys in sorted(wanted.items()):
            src = self.sources[s]
            got = fetch_rows(src.shards[sh].path, src.fmt[sh], self.text_field, self.corpus.storage_options, keys,
                             self.settings.max_record_bytes)
            texts.update({(s, sh, k): t for k, t in got.items()})
        for d in [*self.pending, *(d for src in self.sources for d in src.buffer)]:
            d.record = texts[(d.source, d.shard, d.key)]
        self._tokenize(list(self.pending))
        check_carry(self)

    # --------------------------------------------------------------------------------------- sequences
    def next_sequence(self) -> np.ndarray:
        """The next sequence: documents joined, the tail of a long one carried over; its labels in ``last_labels``."""
        n = self.settings.seq_length
        out = np.empty(n, dtype=np.int64)
        labels = np.empty(n, dtype=np.int64)
        filled = 0
        while filled < n:
            if not self.pending:
                self._draw()
            doc = self.pending[0]
            assert doc.tokens is not None and doc.labels is not None
            take = min(len(doc.tokens) - self.offset, n - filled)
            out[filled:filled + take] = doc.tokens[self.offset:self.offset + take]
            labels[filled:filled + take] = doc.labels[self.offset:self.offset + take]
            self.sources[doc.source].tokens += take
            self.trained_epoch = doc.epoch
            filled += take
            self.offset += take
            if self.offset == len(doc.tokens):
                self.pending.popleft()
                self.offset = 0
        self.sequences += 1
        self.last_labels = labels
        return out

    def __iter__(self) -> Iterator[np.ndarray]:
        while True:
            try:
                yield self.next_sequence()
            except _End:
                return

    def _draw(self) -> None:
        drawn = []
        for _ in range(self.draw_batch):
            s = order.blend_pick(self.seed, self.docs, self.weights) if len(self.sources) > 1 else 0
            try:
                drawn.append(self._take(self.sources[s]))
            except _End:
                if not drawn:
                    raise
                break
            self.docs += 1
        self._tokenize(drawn)
        self.pending.extend(drawn)

    def _tokenize(self, docs: list[_Doc]) -> None:
        """Encode ``docs`` in one batch (in place); a record that fails is skipped and counted, or ``DataError``."""
        todo = [d for d in docs if d.tokens is None]
        while todo:
            try:
                encoded = self.encoder.encode([d.record for d in todo])
            except BadRecord as bad:
                self._bad(f"{doc_ref(self.sources[todo[bad.index].source], todo[bad.index])}: {bad.reason}")
                docs.remove(todo.pop(bad.index))
                continue
            for d, (ids, labels) in zip(todo, encoded):
                d.tokens, d.labels = ids, labels
            return

    def _take(self, src: _Source) -> _Doc:
        """The next document of ``src`` out of its shuffle buffer (filled first). The buffer does not span epochs:
        at the end of an epoch it is emptied before the next epoch's first row enters it, so every epoch hands out
        each good row exactly once."""
        while len(src.buffer) < self.buffer_size:
            if src.pos >= len(self._order(src)):  # this epoch's rows are all read
                if src.buffer:
                    break
                self._next_epoch(src)
            try:
                src.buffer.append(self._read(src))
            except _EpochEnd:  # the epoch's last rows were bad: the loop ends it
                continue
        j = order.buffer_pick(self.seed, src.index, src.taken, len(src.buffer))
        src.taken += 1
        doc = src.buffer[j]
        src.buffer[j] = src.buffer[-1]
        src.buffer.pop()
        doc.epoch = src.epoch  # the buffer never spans epochs
        return doc

    def _order(self, src: _Source) -> list[int]:
        """This lane's units of the epoch, in order: its share of the epoch's seeded order of all units."""
        if src.order_cache is None or src.order_cache[:2] != (src.epoch, src.n):
            whole = order.shard_order(src.n, self.settings.seed, src.index, src.epoch, self.settings.shuffle)
            mine = whole[self.lane::self.lanes] if src.n >= self.lanes else [whole[self.lane % src.n]]
            src.order_cache = (src.epoch, src.n, mine)
        return src.order_cache[2]

    def _read(self, src: _Source) -> _Doc:
        """The next good row of ``src`` in this epoch's order (bad ones skipped); ``_EpochEnd`` after the last."""
        mine = self._order(src)
        while src.pos < len(mine):
            shard = mine[src.pos]
            sh = src.shards[shard]
            ranged = sh.stop >= 0 and src.fmt[shard] in ("json", "text")  # a byte range of a line file
            if src.rows is None:
                limit, opts = self.settings.max_record_bytes, self.corpus.storage_options
                if src.seen == 0 and src.key < sh.first:  # a row-group or byte-range unit starts inside its file
                    src.key = line_start(sh.path, opts, sh.first, limit) if ranged else sh.first
                    src.row = 0 if ranged else sh.first
                src.rows = read_rows(sh.path, src.fmt[shard], self.text_field, opts, src.key, src.row, sh.stop, limit)
            row = next(src.rows, None)
            if row is None:
                if src.seen == 0 and not ranged:
                    self._bad(f"{src.shards[shard].name}: empty shard (no rows)")
                self.empty_units = self.empty_units + 1 if src.epoch_rows == 0 else 0
                self._next_shard(src)
                continue
            src.seen += 1
            if row.error is None and row.record is not None:
                row.error = self.encoder.check(row.record)
            if row.error is not None:
                whole = row.next_key <= row.key
                where = "" if whole else f" row at byte {row.key}" if ranged else f" row {row.row}"
                self._bad(f"{src.shards[shard].path}{where}: {row.error}")
                if whole:
                    self._next_shard(src)
                else:
                    src.key, src.row = row.next_key, row.row + 1
                continue
            src.key, src.row = row.next_key, row.row + 1
            src.epoch_rows += 1
            return _Doc(src.index, shard, row.key, row.record or {})
        raise _EpochEnd()

    def _next_shard(self, src: _Source) -> None:
        src.rows = None
        src.pos, src.key, src.row, src.seen = src.pos + 1, 0, 0, 0

    def _next_epoch(self, src: _Source) -> None:
        """The next epoch of ``src`` (its shards, appended ones included, in the next seeded order)."""
        if src.epoch_rows == 0 and (self.lanes == 1 or self.empty_units > 2 * src.n + 8):
            raise DataError(f"dataset: no readable row in any of the {src.n} shards of source {src.index} "
                            f"(first: {src.shards[0].path})")
        if self.settings.one_pass:
            raise _End()
        src.epoch, src.pos, src.n, src.epoch_rows = src.epoch + 1, 0, len(src.shards), 0

    def _bad(self, what: str) -> None:
        limit = self.settings.skip_bad_rows
        if self.skipped >= limit:
            hint = (f"data.skip_bad_rows ({limit}) reached" if limit else
                    "--data.skip_bad_rows N skips up to N such rows")
            raise DataError(f"{what} ({hint})")
        self.skipped += 1
        self.last_skip = what

    # -------------------------------------------------------------------------------------------- misc
    @property
    def epoch(self) -> int:
        """The epoch of the data trained on: that of the document that ended the last sequence."""
        return self.trained_epoch

    def source_tokens(self) -> list[int]:
        return [s.tokens for s in self.sources]
