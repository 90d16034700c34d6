"""A streamed corpus's checkpointed position read back: its corpus, its lane count and each lane's bounds checked.

Untrusted: every count and index that drives a read is bounded, and every file it names is the recipe's own.
"""

from __future__ import annotations

from typing import Any

from automodel_ckpt.data.stream.corpus import Shard
from automodel_ckpt.data.stream.readers import DataError, malformed
from automodel_ckpt.ondisk import is_count

#: Version of the loader's state: the lane count, the corpus once, each lane's position and counts.
LANES_VERSION = 3


def lanes_mismatch(saved: Any, now: int) -> str:
    return (f"data.lanes: the run's data order was made over {saved} lanes, this recipe says {now}; the lane count is "
            f"part of the run's identity: resume with --data.lanes {saved}")


def lane_counts(stream: Any) -> list[int]:
    """A lane's part of the step's totals: ``[epoch trained on, bad rows skipped, tokens per source ...]``."""
    return [int(stream.trained_epoch), int(stream.skipped), *[int(t) for t in stream.source_tokens()]]


def check_corpus(saved: list[Shard], now: list[Shard], allow_appended: bool,
                 source: int | None = None) -> list[list[Any]]:
    """The checkpoint's unit records (and, ``allow_appended``, new files'); a file changed or gone: ``DataError``."""
    where = f"dataset.sources[{source}]" if source is not None else "dataset"
    current = {s.path: s for s in now}
    for s in saved:
        c = current.get(s.path)
        if c is None:
            raise DataError(f"{where}: shard '{s.path}' of the checkpoint's corpus is gone; the corpus is part of "
                            "the run's identity (restore the file, or start a new run)")
        if (c.size, c.version) != (s.size, s.version):
            raise DataError(f"{where}: shard '{s.path}' changed since the checkpoint (size {s.size} -> {c.size}, "
                            f"version {s.version} -> {c.version}); restore it, or start a new run")
    known = {s.path for s in saved}
    added = [s for s in now if s.path not in known]
    if added and not allow_appended:
        raise DataError(f"{where}: {len({s.path for s in added})} shard(s) added since the checkpoint (first: "
                        f"'{added[0].path}'); --data.allow_appended_shards true reads them from the next epoch on")
    return [s.record() for s in [*saved, *added]]


def _ints(values: Any, low: int, high: int, what: str) -> None:
    if not isinstance(values, list) or not all(isinstance(v, int) and low <= v < high for v in values):
        raise malformed(what)


def _counts(values: Any, what: str) -> None:
    if not isinstance(values, list) or not all(is_count(v) for v in values):
        raise malformed(what)


def _check_stream(p: Any, sizes: list[int], buffer: int, draw: int) -> None:
    """One stream's position (a lane's, or the one global stream's) against its sources' unit counts."""
    if not isinstance(p, dict) or not isinstance(p.get("sources"), list) or not isinstance(p.get("pending"), list):
        raise malformed("not a position")
    if len(p["sources"]) != len(sizes):
        raise DataError(f"dataset: the checkpoint's corpus has {len(p['sources'])} sources, this recipe {len(sizes)}")
    _counts([p.get(k) for k in ("docs", "offset", "sequences", "skipped", "epoch")], "counters")
    if "packed" in p and not (isinstance(p["packed"], list) and len(p["packed"]) == 2):
        raise malformed("where its sequence length began")
    _counts(p.get("packed", [0, 0]), "where its sequence length began")
    for src, n in zip(p["sources"], sizes):
        if not isinstance(src, dict):
            raise malformed("a source")
        _counts([src.get(k) for k in ("epoch", "key", "row", "seen", "epoch_rows", "taken", "tokens")],
                "a source's counters")
        _ints([src.get("n")], 1, n + 1, "the shards of an epoch")
        _ints([src.get("pos")], 0, src["n"] + 1, "the place in the shard order")
        _ints(src.get("buffer_shards"), 0, n, "the shuffle buffer")
        _counts(src.get("buffer_keys"), "the shuffle buffer")
        if len(src["buffer_shards"]) != len(src["buffer_keys"]) or len(src["buffer_keys"]) > buffer:
            raise malformed(f"a shuffle buffer of {len(src['buffer_keys'])} rows, more than {buffer}")
    if len(p["pending"]) > draw + 1:
        raise malformed("too many pending documents")
    for d in p["pending"]:
        if not (isinstance(d, list) and len(d) == 4 and all(isinstance(v, int) for v in d)
                and 0 <= d[0] < len(sizes) and 0 <= d[1] < sizes[d[0]] and d[2] >= 0 and d[3] >= 0):
            raise malformed("a pending document")


def check_position(p: Any, shuffle_buffer: int) -> None:
    """The shape and bounds of the one global stream's position of a checkpoint written before lanes."""
    from automodel_ckpt.data.stream.stream import DRAW_BATCH

    if not isinstance(p, dict) or not isinstance(p.get("sources"), list):
        raise malformed("not a position")
    sizes = []
    for src in p["sources"]:
        if not isinstance(src, dict) or not isinstance(src.get("shards"), list) or not src["shards"]:
            raise malformed("a source without shards")
        if not all(isinstance(r, list) and len(r) in (3, 5) and isinstance(r[0], str) and isinstance(r[1], int)
                   and all(isinstance(v, int) for v in r[3:]) for r in src["shards"]):
            raise malformed("a shard record")
        sizes.append(len(src["shards"]))
    _check_stream(p, sizes, shuffle_buffer, DRAW_BATCH)


def check_lane(p: Any, counts: Any, shards: list[list[Shard]], buffer: int, sequences: int) -> None:
    """A lane's position and counts against the corpus's units, its buffer size and the sequences it made."""
    from automodel_ckpt.data.stream.stream import DRAW_BATCH, LANE_DRAW_BATCH

    _check_stream(p, [len(s) for s in shards], buffer, max(DRAW_BATCH, LANE_DRAW_BATCH))
    if p["sequences"] != max(sequences, 0):
        raise malformed("a lane's sequence count")
    _counts(counts, "a lane's counts")
    if len(counts) != 2 + len(shards):
        raise malformed("a lane's counts")


def old_position_to_lanes(p: Any, lanes: int, shuffle_buffer: int) -> dict[str, Any] | None:
    """The state of a checkpoint written before lanes: exact with ``data.lanes: 1``, else ``DataError``."""
    if p is None:
        return None
    if lanes != 1:
        raise DataError(f"data.lanes: the checkpoint's data position is one global stream (written before lanes), "
                        f"this recipe reads {lanes} lanes; resume it with --data.lanes 1 (the same order, exactly)")
    check_position(p, shuffle_buffer)
    lane = {k: v for k, v in p.items() if k != "sources"}
    lane["sources"] = [{k: v for k, v in s.items() if k != "shards"} for s in p["sources"]]
    counts = [int(p["epoch"]), int(p["skipped"]), *[int(s["tokens"]) for s in p["sources"]]]
    return {"kind": "stream", "version": LANES_VERSION, "lanes": 1, "sequences": int(p["sequences"]),
            "shards": [s["shards"] for s in p["sources"]], "positions": {0: lane}, "counts": {0: counts}}
