"""The pure functions that fix a streamed corpus's global order: shard order per epoch, shuffle-buffer picks, blends.

Every choice is a function of ``(seed, a counter)`` alone, so any reader (any rank, any worker, any world size)
that starts from the same position makes the same choices, and a position needs no random-generator state.
"""

from __future__ import annotations

import numpy as np

_MASK = (1 << 64) - 1


def mix64(*values: int) -> int:
    """A 64-bit hash of integers (splitmix64 steps): stable across processes, platforms and Python versions."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & _MASK)) & _MASK
        h = (h + 0x9E3779B97F4A7C15) & _MASK
        z = h
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        h = z ^ (z >> 31)
    return h


def shard_order(num_shards: int, seed: int, source: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The order in which epoch ``epoch`` of source ``source`` reads its first ``num_shards`` shards."""
    if not shuffle:
        return list(range(num_shards))
    rng = np.random.Generator(np.random.PCG64([seed & _MASK, source, epoch, 0x5EED]))
    return [int(i) for i in rng.permutation(num_shards)]


def buffer_pick(seed: int, source: int, taken: int, size: int) -> int:
    """Which of the ``size`` rows in the shuffle buffer leaves it as the ``taken``-th row of the source."""
    return mix64(seed, source, 0xB0FF, taken) % size


def blend_pick(seed: int, doc: int, weights: list[float]) -> int:
    """The source of the blend's ``doc``-th document: a seeded draw by ``weights`` (any sum; 0: never drawn)."""
    u = (mix64(seed, 0xB1E4D, doc) >> 11) / float(1 << 53) * sum(weights)
    acc = 0.0
    for i, w in enumerate(weights):
        acc += w
        if u < acc:
            return i
    return max(i for i, w in enumerate(weights) if w > 0)  # (rounding) the last that may be drawn, never weight 0


def sequence_id(tokens: np.ndarray) -> int:
    """A 52-bit id of a sequence's tokens (exact through a float64 sum over ranks): equal ids, equal sequences."""
    import hashlib

    digest = hashlib.blake2b(np.ascontiguousarray(tokens, dtype=np.int64).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 12
