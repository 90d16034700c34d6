"""A model folder's tensors as pieces of files: what a format's export source (``ModelFormat.open_source``) returns.

The Hugging Face export (``export.sources``) checks their coverage and reads them one piece at a time."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass(frozen=True)
class Piece:
    """One rank's box of a tensor at ``offsets`` of size ``shape``: raw C-order bytes at ``[start, start + length)``
    of ``file``, or a ``torch.save`` payload (``raw`` False, maybe ``transforms``) whose elements ``select`` takes."""

    file: Path
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    start: int
    length: int
    raw: bool = True
    transforms: tuple[str, ...] = ()
    select: tuple[int, int] | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class SourceTensor:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: list[Piece] = field(default_factory=list)
    base_shape: tuple[int, ...] | None = None
    """Set for a strided view of a saved tensor: ``pieces`` tile a tensor of this shape, ..."""
    view: tuple[int, tuple[int, ...]] | None = None
    """... and this tensor is its ``as_strided(shape, stride, offset)`` view, given as ``(offset, stride)``."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class ShardSource:
    """All tensors of one model folder, by name, with the pieces that make them up."""

    folder: Path
    format: str
    tensors: dict[str, SourceTensor]
    files: list[Path]

    def fingerprint(self) -> list[tuple[str, int, int]]:
        """Name, size and mtime of every shard file: identifies this exact set of shards."""
        return [(f.name, (st := f.stat()).st_size, st.st_mtime_ns) for f in self.files]
