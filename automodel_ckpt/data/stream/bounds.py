"""A restored stream position's fields against their real bounds: rows in their files, counts that add up.

A checkpoint's position is untrusted: ``position`` checks its shape; here, before any row is read back, every row
reference lies inside its file, the counts add up as the stream makes them (tokens = sequences x ``seq_length``
since ``packed``), and the carry-over lies inside the first pending document. Each failure is one ``DataError`` line.
"""

from __future__ import annotations

from types import SimpleNamespace as _View
from typing import Any

from automodel_ckpt.data.stream.readers import malformed

COUNTERS = ("epoch", "n", "pos", "key", "row", "seen", "epoch_rows", "taken", "tokens")  # a source's, in record order


def _uncompressed(path: str) -> bool:
    from fsspec.utils import infer_compression

    return infer_compression(path) is None


def _row_bound(shard: Any, fmt: str, key: int) -> str | None:
    """Why row reference ``key`` cannot be a row of ``shard`` (None: it may be)."""
    if fmt in ("parquet", "arrow"):
        if shard.stop >= 0 and not shard.first <= key < shard.stop:
            return f"row {key} of '{shard.path}', outside its shard's rows {shard.first}-{shard.stop - 1}"
        return None
    if _uncompressed(shard.path) and key >= shard.size:
        return f"a row at byte {key} of '{shard.path}', a file of {shard.size} bytes"
    return None


def _doc_bound(stream: Any, doc: Any, what: str) -> None:
    if not 0 <= doc.source < len(stream.sources) or not 0 <= doc.shard < len(stream.sources[doc.source].shards):
        raise malformed(f"{what}: shard {doc.shard} of source {doc.source}, which the corpus does not have")
    src = stream.sources[doc.source]
    why = _row_bound(src.shards[doc.shard], src.fmt[doc.shard], doc.key)
    if why is not None:
        raise malformed(f"{what}: {why}")


def check_restored(stream: Any) -> None:
    """A position just restored into ``stream`` against the corpus's files and its own counts."""
    seq_length = int(stream.settings.seq_length)
    for src in stream.sources:
        where = f"source {src.index}"
        for d in src.buffer:
            _doc_bound(stream, d, f"{where}'s shuffle buffer")
        lines = [s for s, f in zip(src.shards, src.fmt) if f not in ("parquet", "arrow") and _uncompressed(s.path)]
        if lines and len(lines) == len(src.shards):  # every shard a plain line file: the next row is in one of them
            largest = max(s.size for s in lines)
            if src.key > largest:
                raise malformed(f"{where}'s next row is at byte {src.key}, past the end of its largest file "
                                f"({largest} bytes)")
            if src.row > src.key:
                raise malformed(f"{where}'s next row is row {src.row} at byte {src.key}: more rows than bytes")
    for d in stream.pending:
        _doc_bound(stream, d, "a pending document")
        if d.epoch > stream.sources[d.source].epoch:
            raise malformed(f"a pending document of epoch {d.epoch}, its source is at epoch "
                            f"{stream.sources[d.source].epoch}")
    tokens = sum(src.tokens for src in stream.sources)
    made, given = stream.packed  # where it began packing at this length (a stage's new one; docs/stages.md)
    if not (made <= stream.sequences and given <= tokens) or tokens - given != (stream.sequences - made) * seq_length:
        since = f" ({stream.sequences - made} since it began packing at this length)" if made else ""
        raise malformed(f"the sources gave {tokens} tokens to {stream.sequences} sequences of {seq_length}{since}")
    taken = sum(src.taken for src in stream.sources)
    if taken != stream.docs:
        raise malformed(f"{taken} documents taken from the sources' buffers, {stream.docs} drawn")
    if len(stream.pending) > stream.docs:
        raise malformed(f"{len(stream.pending)} pending documents of {stream.docs} drawn")
    if stream.trained_epoch > max((src.epoch for src in stream.sources), default=0):
        raise malformed(f"the data trained on is of epoch {stream.trained_epoch}, past every source's")


def check_fields(p: dict[str, Any], shards: list[list[Any]], corpus: Any, seq_length: int) -> None:
    """``check_restored`` of one lane's position as read from a checkpoint, so that the refusal names its file."""
    from automodel_ckpt.data.stream.corpus import file_format

    sources = []
    for i, (rec, listed) in enumerate(zip(p["sources"], shards)):
        src = _View(index=i, shards=listed, fmt=[file_format(s.path, corpus.sources[i].format) for s in listed],
                    **{k: rec[k] for k in COUNTERS})
        src.buffer = [_View(source=i, shard=sh, key=k, epoch=0) for sh, k in zip(rec["buffer_shards"],
                                                                                  rec["buffer_keys"])]
        sources.append(src)
    check_restored(_View(settings=_View(seq_length=seq_length), sources=sources, docs=p["docs"],
                         sequences=p["sequences"], trained_epoch=p["epoch"], packed=tuple(p.get("packed", (0, 0))),
                         pending=[_View(source=s, shard=sh, key=k, epoch=e) for s, sh, k, e in p["pending"]]))


def check_carry(stream: Any) -> None:
    """The carry-over (``offset``: tokens of the first pending document already packed) inside it; 0 without one."""
    if not stream.pending:
        if stream.offset:
            raise malformed(f"a carry-over of {stream.offset} tokens and no pending document")
        return
    first = stream.pending[0]
    n = len(first.tokens or [])
    if not 0 <= stream.offset < n:
        src = stream.sources[first.source]
        raise malformed(f"a carry-over of {stream.offset} tokens into {doc_ref(src, first)}, a document of {n} tokens")


def doc_ref(src: Any, doc: Any) -> str:
    """A row reference in words: the file and the row (parquet, arrow) or its byte offset."""
    if not 0 <= doc.shard < len(src.shards):
        return f"shard {doc.shard}"
    kind = "row" if src.fmt[doc.shard] in ("parquet", "arrow") else "row at byte"
    return f"'{src.shards[doc.shard].path}' {kind} {doc.key}"
