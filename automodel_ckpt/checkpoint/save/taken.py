"""A small state's value taken at the save, in memory, and serialized as ``torch.save`` would have then, later.

The C pickler takes it on the training thread (``torch.save`` there costs a Python call per object), its plain
tensors cloned aside (a ``Parameter`` is pickled by its own reduction); ``bytes()`` runs ``torch.save`` off it: the
same bytes, but views of one storage are saved each on its own.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from automodel_ckpt.ondisk.formats.safe_load import unpickle_own


class Taken:
    """``value`` as it is now (``bytes()``: what ``torch.save(value)`` wrote when this was made)."""

    def __init__(self, value: Any) -> None:
        self._tensors: list[torch.Tensor] = []
        buffer = io.BytesIO()
        _Pickler(buffer, self._tensors).dump(value)
        self._pickled = buffer.getvalue()

    def value(self) -> Any:
        """A copy of the value as it was taken."""
        return unpickle_own(self._pickled, (__name__, _set_aside.__name__), self._tensors.__getitem__)

    def bytes(self) -> bytes:
        buffer = io.BytesIO()
        torch.save(self.value(), buffer)
        return buffer.getvalue()


def _set_aside(index: int) -> torch.Tensor:
    """Where a pickled value refers to a tensor set aside (``value`` resolves it to that tensor)."""
    raise RuntimeError("a tensor set aside is read back by its own unpickler only")


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, tensors: list[torch.Tensor]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._tensors = tensors

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is torch.Tensor and not obj.requires_grad:
            with torch.no_grad():
                self._tensors.append(obj.clone())
            return _set_aside, (len(self._tensors) - 1,)
        return NotImplemented
