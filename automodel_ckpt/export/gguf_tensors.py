"""A GGUF file's tensors read back one at a time (dequantized, with their rounding step), and a model's GGUF mapping.

``open_gguf_tensors`` reads the header with ``gguf_read.open_gguf`` (bounded: every count and length checked), then
checks every tensor's bytes lie inside the file, sized for its type and shape, none overlapping another's, before
any is read (``gguf_read.refuse_misplaced_tensors``, as `pack` checks): a truncated or damaged file, or one whose
tensors share bytes (a few MiB read again for each of thousands of tensors), is one ``CheckpointError`` line, so
reading every tensor once reads at most the file. A tensor is read when asked for (positioned reads, one tensor in
memory), dequantized by the ``gguf`` library, in the file's layout (outermost dimension first). Its ``step`` is the
rounding of its storage type, per element: a float type's half unit in the last place; a block-quantized type's
step, the block's largest magnitude over the type's levels (``2 ** (bits - 1)``, bits a value's whole bits: 127 for
``q8_0``, 8 for ``q4_0``), one step being the most round-to-nearest loses where the range clamps.
``gguf_mapping`` is the export's own mapping of a model's tensors (``gguf_arch``: names, rotary permutation, Conv1D
transposes, stacked experts, norms plus one) for a model of ``config`` with tensors of ``shapes``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from automodel_ckpt.errors import CheckpointError, UserError
from automodel_ckpt.export.gguf_arch import OutputTensor, family_for, output_tensors
from automodel_ckpt.export.gguf_read import GGUFTensor, open_gguf, refuse_misplaced_tensors
from automodel_ckpt.ondisk import open_regular

_FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


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
        """Each element's rounding step in the tensor ``name`` read as ``value`` (module docstring)."""
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
