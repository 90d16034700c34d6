"""An int8 folder read back: each quantized weight dequantized with its scales, and the step of its rounding.

For each quantized weight ``X.weight`` a compressed-tensors folder holds its integers (``X.weight`` int8, or
``X.weight_packed`` int4 in int32 with ``X.weight_shape``) and ``X.weight_scale`` (per row or group).
``dequantize_int8`` gives ``X.weight`` as ``integers x scale`` in float32, the rest hidden, and as its
``steps`` each element's scale: one step of the rounding that made it. Only symmetric schemes are read.
"""

from __future__ import annotations

from typing import Any

import torch

from automodel_ckpt.errors import CheckpointError
from automodel_ckpt.export.model_source import ModelSource

INT8_FORMATS = ("int-quantized", "pack-quantized")
_HIDDEN = ("weight_scale", "weight_packed", "weight_shape", "input_scale", "weight_zero_point", "input_zero_point")


def is_int8(config: dict[str, Any]) -> bool:
    """Whether ``config`` (a folder's ``config.json``) is a compressed-tensors folder of a format read here."""
    quant = config.get("quantization_config")
    return isinstance(quant, dict) and quant.get("format") in INT8_FORMATS


def dequantize_int8(source: ModelSource) -> ModelSource:
    """The model of the int8 folder ``source`` with its weights dequantized (module docstring)."""
    out = ModelSource(source.config, source.side_dir, kind="int8 folder", name=source.name, where=source.where)
    stems = {n.removesuffix(".weight_scale") for n in source.shapes if n.endswith(".weight_scale")}
    for stem in sorted(stems):
        if f"{stem}.weight_zero_point" in source.shapes:
            raise CheckpointError(f"int8 folder: '{stem}' has a zero point (an asymmetric scheme), which is not read")
        packed = f"{stem}.weight_packed" in source.shapes
        shape = _packed_shape(source, stem) if packed else source.shapes.get(f"{stem}.weight")
        if shape is None:
            raise CheckpointError(f"int8 folder: '{stem}' has a weight_scale but no weight")
        scale_shape = source.shapes[f"{stem}.weight_scale"]
        if len(shape) != 2 or len(scale_shape) != 2 or scale_shape[0] != shape[0] or not scale_shape[1] or \
                shape[1] % scale_shape[1]:
            raise CheckpointError(f"int8 folder: '{stem}' has scales of shape {list(scale_shape)} for a weight of "
                                  f"shape {list(shape)}")
        step = lambda stem=stem, shape=shape: _scales(source, stem, shape)  # noqa: E731
        integers = (lambda stem=stem, shape=shape: _unpack(source, stem, shape)) if packed else \
            (lambda stem=stem: source.read(f"{stem}.weight").to(torch.float32))
        out.add(f"{stem}.weight", shape, torch.float32, lambda i=integers, s=step: i() * s())
        out.steps[f"{stem}.weight"] = lambda value, s=step: s()  # the scales, whatever the value
        out.formats[f"{stem}.weight"] = "int8"
    for name in source.shapes:
        stem, _, kind = name.rpartition(".")
        if stem in stems and (kind in _HIDDEN or kind == "weight"):
            continue
        out.add(name, source.shapes[name], source.dtypes[name], source.readers[name])
    return out


def _packed_shape(source: ModelSource, stem: str) -> tuple[int, ...]:
    if f"{stem}.weight_shape" not in source.shapes:
        raise CheckpointError(f"int8 folder: '{stem}' has packed weights but no weight_shape")
    values = source.read(f"{stem}.weight_shape").reshape(-1).tolist()
    packed = source.shapes[f"{stem}.weight_packed"]
    if len(values) != 2 or any(v < 1 for v in values) or len(packed) != 2 or packed[0] != values[0] or \
            packed[1] * 8 < values[1]:
        raise CheckpointError(f"int8 folder: '{stem}' has weight_shape {values[:4]} for packed weights of shape "
                              f"{list(packed)}")
    return int(values[0]), int(values[1])


def _unpack(source: ModelSource, stem: str, shape: tuple[int, ...]) -> torch.Tensor:
    from compressed_tensors.compressors.pack_quantized.base import unpack_from_int32

    packed = source.read(f"{stem}.weight_packed")
    return unpack_from_int32(packed, 4, torch.Size(shape)).to(torch.float32)


def _scales(source: ModelSource, stem: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Each element's scale (a row's, or its group's), as a tensor of the weight's shape."""
    scale = source.read(f"{stem}.weight_scale").to(torch.float32)
    return scale.repeat_interleave(shape[1] // scale.shape[1], dim=1)
