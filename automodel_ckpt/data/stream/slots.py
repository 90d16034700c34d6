"""A streamed run's sources across stages (docs/stages.md): which of the checkpoint's sources each of the recipe's is.

Sources keep slots in the order they first appeared, so each keeps its own position whatever the others do: a
recipe's source is the checkpoint's slot of the same ``path`` globs, a new one takes a new slot, and a slot the
recipe no longer names stays with weight 0 (a later stage may continue it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from automodel_ckpt.data.stream.bounds import COUNTERS
from automodel_ckpt.data.stream.corpus import FORMATS, Corpus, Shard, Source
from automodel_ckpt.data.stream.position import check_corpus
from automodel_ckpt.data.stream.readers import DataError, malformed

MAX_SPEC_PATHS = 256  # globs one saved source may list


@dataclass
class Slots:
    """The sources by slot: their corpus, shards, and how many the checkpoint had (the slots after: new, read from
    their beginning)."""

    corpus: Corpus
    shards: list[list[Shard]]
    saved: int


def specs(corpus: Corpus) -> list[list[Any]]:
    """What a checkpoint records of each slot's source: ``[globs, declared format]``."""
    return [[list(s.paths), s.format] for s in corpus.sources]


def arrange(corpus: Corpus, now: list[list[Shard]], saved_shards: Any, saved_specs: Any, allow_appended: bool) -> Slots:
    """The slots of a stream resumed from a checkpoint's shards and specs (None: the recipe's sources by index)."""
    if not isinstance(saved_shards, list) or not saved_shards or \
            not all(isinstance(s, list) and s for s in saved_shards):
        raise malformed("its sources")
    many = len(corpus.sources) > 1
    if saved_specs is None:  # a checkpoint written before slots: the same sources, in the same order
        if len(saved_shards) != len(now):
            raise DataError(f"dataset: the checkpoint's corpus has {len(saved_shards)} sources, this recipe {len(now)}")
        saved_specs = specs(corpus)
    _check_specs(saved_specs, len(saved_shards))
    of_recipe: list[int] = []
    free = list(range(len(saved_shards)))
    for source in corpus.sources:
        match = next((i for i in free if saved_specs[i][0] == list(source.paths)), None)
        if match is not None:
            free.remove(match)
        of_recipe.append(match if match is not None else -1)
    sources: list[Source] = [Source(list(p), 0.0, f) for p, f in saved_specs]
    shards: list[list[Shard]] = []
    for i, saved in enumerate(saved_shards):
        units = [Shard(*r) for r in _records(saved)]
        if i in of_recipe:  # named by the recipe: its files checked as a resume checks them
            j = of_recipe.index(i)
            units = [Shard(*r) for r in check_corpus(units, now[j], allow_appended, j if many else None)]
            sources[i] = replace(corpus.sources[j])
        shards.append(units)
    for j, slot in enumerate(of_recipe):
        if slot < 0:  # a source the checkpoint does not have: a new slot, from its beginning
            sources.append(replace(corpus.sources[j]))
            shards.append(list(now[j]))
    return Slots(replace(corpus, sources=sources), shards, len(saved_shards))


def _check_specs(saved: Any, count: int) -> None:
    """A checkpoint's ``source_specs``: one ``[globs, format]`` per slot (untrusted)."""
    if not isinstance(saved, list) or len(saved) != count or not all(
            isinstance(s, list) and len(s) == 2 and isinstance(s[0], list) and 0 < len(s[0]) <= MAX_SPEC_PATHS
            and all(isinstance(p, str) and 0 < len(p) <= 4096 for p in s[0])
            and (s[1] is None or s[1] in set(FORMATS.values())) for s in saved):
        raise malformed("its sources' globs")


def _records(saved: Any) -> list[list[Any]]:
    """A slot's unit records as written (``Shard.record``), checked for their shape."""
    if not all(isinstance(r, list) and len(r) in (3, 5) and isinstance(r[0], str) and isinstance(r[1], int)
               and isinstance(r[2], str) and all(isinstance(v, int) for v in r[3:]) for r in saved):
        raise malformed("a shard record")
    return saved


def fresh_source(n: int) -> dict[str, Any]:
    """A lane's position of a source it has not read yet (``stream._Source.record`` of a new one)."""
    return {**dict.fromkeys(COUNTERS, 0), "n": n, "buffer_shards": [], "buffer_keys": []}
