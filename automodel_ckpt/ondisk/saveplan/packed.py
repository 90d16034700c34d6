"""Large parts of what every rank sends a save's coordinator, sent as a pickle and its digest, read once each.

The coordinator's ``Unpacker`` reads each distinct one once (restricted unpickler), one object for every sender."""

from __future__ import annotations

import hashlib
import io
import pickle
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from automodel_ckpt.ondisk.formats.safe_load import RestrictedUnpickler


@dataclass(frozen=True)
class Packed:
    """A part sent as its pickle and that pickle's digest."""

    digest: str
    data: bytes


def pack(value: Any) -> Packed:
    data = pickle.dumps(value, protocol=4)
    return Packed(hashlib.blake2b(data, digest_size=16).hexdigest(), data)


def items_packed(columns: Any) -> Any:
    """Columns (``plan_columns.Columns``, ``result_columns.ResultColumns``) with their item list ``Packed``."""
    return replace(columns, items=pack(columns.items))


def sharing(values: list[Any]) -> list[list[int]]:
    """The places of ``values`` grouped by the object each holds, in order of first appearance."""
    groups: dict[int, list[int]] = {}
    for place, value in enumerate(values):
        groups.setdefault(id(value), []).append(place)
    return list(groups.values())


class Unpacker:
    """The coordinator's reader of the ``Packed`` parts of one save: each distinct one unpickled once."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def __call__(self, part: Any) -> Any:
        if not isinstance(part, Packed):
            return part
        found = self.seen.get(part.digest)
        if found is None:
            found = self.seen[part.digest] = RestrictedUnpickler(io.BytesIO(part.data)).load()
        return found

    def items(self, columns: Any) -> Any:
        return replace(columns, items=self(columns.items))


def int_bytes(values: list[int]) -> tuple[bytes, int]:
    """``values`` as native int32 bytes where every one fits, else int64; and that width (4 or 8)."""
    array = np.asarray(values, dtype=np.int64)
    if not array.size or (array.min() >= -(1 << 31) and array.max() < (1 << 31)):
        return array.astype(np.int32).tobytes(), 4
    return array.tobytes(), 8


def ints(data: bytes, width: int) -> np.ndarray:
    """The integers ``int_bytes`` wrote (int32 or int64, read in place)."""
    return np.frombuffer(data, dtype=np.int32 if width == 4 else np.int64)


def stacked(numbers: list[np.ndarray], length: int) -> np.ndarray:
    """The numbers of ranks that sent one item list as int64 rows ``[ranks, length + 1]``, the last column a zero
    (where a layout points for a number an item has not got); ``ValueError`` for a rank of other than ``length``."""
    out = np.zeros((len(numbers), length + 1), dtype=np.int64)
    if length:
        out[:, :length] = np.stack(numbers)
    elif any(len(n) for n in numbers):
        raise ValueError("numbers for an item list that has none")
    return out
