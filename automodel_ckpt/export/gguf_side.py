"""A GGUF file as one side of `diff`: its tensors read back (dequantized, with their rounding) and paired by name.

The other side (a checkpoint, a folder, an archive, an int8 folder) is put through the GGUF export's own mapping
(``gguf_mapping``), one tensor at a time, and compared with the file's tensor dequantized, in the file's layout,
under the model's name (a stacked expert tensor as one entry per expert); a file's tensor the mapping does not make
keeps its GGUF name, and two GGUF files are compared by those. Each file tensor carries its storage type's rounding
step, so a model and its own GGUF export are ``close``. Every tensor's bytes are checked to lie inside the file,
none overlapping, before any is read: reading every tensor once reads at most the file.
"""

from __future__ import annotations

import functools
import math
import os
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from automodel_ckpt.errors import CheckpointError, UserError
from automodel_ckpt.export.gguf_arch import OutputTensor, family_for, output_tensors
from automodel_ckpt.export.gguf_read import GGUFTensor, open_gguf, refuse_misplaced_tensors
from automodel_ckpt.export.model_source import ModelSource
from automodel_ckpt.ondisk import open_regular

__all__ = ["gguf_alone", "gguf_beside"]

_KIND = "GGUF file"
_FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


def gguf_alone(path: Path, stack: ExitStack) -> ModelSource:
    """The GGUF file ``path`` by its own tensor names."""
    file = open_gguf_tensors(path, stack)
    out = ModelSource({}, kind=_KIND, where=str(path))
    for name, shape in file.shapes.items():
        _add(out, file, name, name, shape, lambda name=name: file.read(name))
    return out


def gguf_beside(model: ModelSource, path: Path, stack: ExitStack) -> tuple[ModelSource, ModelSource]:
    """``model`` as the GGUF export lays it out, and the GGUF file ``path``, both under the model's names."""
    file = open_gguf_tensors(path, stack)
    mapping = gguf_mapping(model.config, model.shapes)
    laid, read = ModelSource(model.config, where=model.where), ModelSource({}, kind=_KIND, where=str(path))
    whole = functools.lru_cache(maxsize=1)(file.read)  # a stacked tensor read once for all its experts
    made: set[str] = set()
    for t in mapping:
        if t.name not in file.shapes:  # the model's tensors the file lacks
            for source in t.sources:
                _as_saved(laid, model, source)
            continue
        made.add(t.name)
        if len(t.sources) == 1:
            name = t.sources[0] if t.sources[0] not in laid.shapes else t.name  # a tied copy: its GGUF name
            source = t.sources[0]
            laid.shapes[name], laid.dtypes[name] = t.shape, model.dtypes[source]
            laid.readers[name] = lambda t=t, s=source: t.make([model.read_saved(s)])
            if source in model.steps:  # an int8 folder's weight: its step laid out as the value is
                laid.steps[name] = lambda value, t=t, s=source: t.make([model.steps[s](value)])
                laid.formats[name] = model.formats[source]
            _add(read, file, name, t.name, file.shapes[t.name], lambda g=t.name: file.read(g))
            continue
        for e, source in enumerate(t.sources):  # experts stacked along the first dimension
            _as_saved(laid, model, source)
            _add(read, file, source, t.name, file.shapes[t.name][1:], lambda g=t.name, e=e: whole(g)[e])
    for name, shape in file.shapes.items():
        if name not in made:
            _add(read, file, name, name, shape, lambda name=name: file.read(name))
    return laid, read


def _as_saved(out: ModelSource, model: ModelSource, source: str) -> None:
    """``model``'s tensor ``source`` in ``out`` as it is saved (with its rounding step where it has one)."""
    out.shapes[source], out.dtypes[source] = model.shapes[source], model.dtypes[source]
    out.readers[source] = lambda: model.read_saved(source)
    if source in model.steps:
        out.steps[source], out.formats[source] = model.steps[source], model.formats[source]


def _add(out: ModelSource, file: Any, name: str, gguf_name: str, shape: tuple[int, ...], read: Any) -> None:
    out.shapes[name], out.dtypes[name], out.readers[name] = tuple(shape), torch.float32, read
    out.steps[name] = lambda value, g=gguf_name: file.step(g, value)
    out.formats[name] = f"GGUF {file.types[gguf_name]}"


@dataclass
class GGUFTensors:
    """The tensors of a GGUF file by name: shape (outermost first) and storage type name; read one at a time."""

    path: Path
    fd: int
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    types: dict[str, str] = field(default_factory=dict)
    _entries: dict[str, GGUFTensor] = field(default_factory=dict)

    def read(self, name: str) -> torch.Tensor:
        """The tensor ``name`` dequantized to float32, in the file's layout."""
        import numpy as np
        from gguf import GGML_QUANT_SIZES
        from gguf.quants import dequantize

        t = self._entries[name]
        block, size = GGML_QUANT_SIZES[t.tensor_type]
        nbytes = t.n_elements // block * size
        data = os.pread(self.fd, nbytes, t.offset) if nbytes else b""
        if len(data) != nbytes:
            raise CheckpointError(f"damaged GGUF file '{self.path}': tensor '{name[:80]}' cut short (truncated)")
        try:
            values = dequantize(np.frombuffer(data, dtype=np.uint8), t.tensor_type)
        except NotImplementedError:
            raise CheckpointError(f"'{self.path}': tensor '{name[:80]}' is stored as {t.tensor_type.name}, which "
                                  "is not read back here") from None
        return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(self.shapes[name])

    def step(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """Each element's rounding step in the tensor ``name`` read as ``value``: a float type's half unit in the
        last place; a block type's, the block's largest magnitude over its levels (``2 ** (bits - 1)``: 127 for
        ``q8_0``), the most round-to-nearest loses where the range clamps."""
        from gguf import GGML_QUANT_SIZES

        kind = self.types[name]
        if kind in _FLOATS:
            return value.abs() * (torch.finfo(_FLOATS[kind]).eps / 2) + torch.finfo(_FLOATS[kind]).tiny
        block, size = GGML_QUANT_SIZES[self._entries[name].tensor_type]
        levels = 2 ** (math.floor(size * 8 / block) - 1)
        rows = value.reshape(-1, block)
        return (rows.abs().amax(dim=1, keepdim=True) / levels).expand_as(rows).reshape(value.shape)


def open_gguf_tensors(path: Path, stack: Any) -> GGUFTensors:
    """The tensors of the GGUF file ``path``, each checked to lie inside it; the file stays open until ``stack``
    (an ``ExitStack``) closes."""
    header = open_gguf(path)
    refuse_misplaced_tensors(header, "it is not compared")
    fd = open_regular(Path(path), follow=True)
    stack.callback(os.close, fd)
    out = GGUFTensors(Path(path), fd)
    for t in header.tensors:
        out.shapes[t.name] = tuple(reversed(t.dims))
        out.types[t.name] = t.tensor_type.name
        out._entries[t.name] = t
    return out


def gguf_mapping(config: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> list[OutputTensor]:
    """The GGUF tensors the export makes of a model of ``config`` whose on-disk tensors have ``shapes``: each
    one's name, shape, source tensors and the transform (``make``); a family GGUF does not know is one line."""
    try:
        return output_tensors(family_for(config), config, shapes)
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"the model's config.json does not say how its tensors map to a GGUF file ({exc})") from None
