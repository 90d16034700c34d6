"""`export --to int8`: a compressed-tensors folder that vLLM serves (W8A8 int8, or W4A16), streamed tensor by tensor.

The scheme, the ``quantization_config`` block and every quantized weight's encoding are the ``compressed-tensors``
library's (presets ``W8A8``, with static activation scales from ``--calibrate N`` examples, and ``W4A16``; its
``calculate_qparams`` and compressors). The decoder layers' linear projections are quantized; embeddings,
``lm_head``, norms and biases keep the base's dtype. One weight is in memory at a time, each written at its planned
offset into a folder beside ``out``, renamed into place when complete.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from automodel_ckpt.ondisk import (HFFolder, copy_regular, fsync_dir, old_sibling, pwrite_all, replace_folder,
                                   tmp_sibling, write_json)
from automodel_ckpt.export.model_source import ModelSource
from automodel_ckpt.export.sources import SourceTensor
from automodel_ckpt.export.writer import OutFile, OutTensor, bytes_of
from automodel_ckpt.errors import CheckpointError, UserError
from automodel_ckpt.sizes import human_size, in_groups

#: ``--scheme`` -> (compressed-tensors preset, its format).
SCHEMES = {"w8a8": ("W8A8", "int-quantized"), "w4a16": ("W4A16", "pack-quantized")}
#: Families whose linear projections are plain ``nn.Linear`` modules named as vLLM loads them.
INT8_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3")
_PROJECTION = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.[a-z_]+_proj\.weight$")
_MAX_FILE = 5 * 2**30


@dataclass
class Int8Plan:
    """Every output tensor (name, dtype, shape) with the source it comes from, file by file."""

    scheme_name: str
    scheme: Any  # compressed_tensors.quantization.QuantizationScheme
    quantized: list[str]
    kept: list[str]
    files: list[list[tuple[str, torch.dtype, tuple[int, ...], str]]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    calibration: list[list[int]] = field(default_factory=list)  # token ids: static activation scales from these
    calibration_origin: str = ""  # where they come from, in words

    @property
    def nbytes(self) -> int:
        return sum(math.prod(shape) * dtype.itemsize for f in self.files for _, dtype, shape, _ in f)

    def describe(self, source: ModelSource) -> str:
        activations = (f", static activation scales from {len(self.calibration)} examples"
                       + (f" of {self.calibration_origin}" if self.calibration_origin else "")
                       if self.calibration else "")
        return (f"int8 {self.scheme_name} of a {source.config.get('model_type')} model (compressed-tensors "
                f"{SCHEMES[self.scheme_name][1]}{activations}): {len(self.quantized)} linear weights quantized, "
                f"{len(self.kept)} tensors kept in their dtype, {human_size(self.nbytes)} in {len(self.files)} "
                f"file(s) from {human_size(source.nbytes)} read")


def plan_int8(source: ModelSource, scheme_name: str, calibration: list[list[int]] | None = None,
              calibration_origin: str = "") -> Int8Plan:
    """The plan for ``source`` in ``scheme_name``; an unknown family or scheme is refused before any work. With
    ``calibration`` (token ids of examples; ``calibration_origin`` says whence), w8a8's activations get static
    per-tensor scales from them."""
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationStatus,
                                                 preset_name_to_scheme)

    if scheme_name not in SCHEMES:
        raise UserError(f"unknown int8 scheme '{scheme_name}'; use one of {', '.join(SCHEMES)}")
    if calibration is not None and scheme_name != "w8a8":
        raise UserError(f"--calibrate: {scheme_name} does not quantize activations; calibration applies to w8a8")
    model_type = str(source.config.get("model_type"))
    if model_type not in INT8_FAMILIES:
        raise UserError(f"int8 export does not know the model family '{model_type}'; it exports "
                        f"{', '.join(INT8_FAMILIES)} (use another --to, or the Hugging Face export, for this model)")
    preset, fmt = SCHEMES[scheme_name]
    scheme = preset_name_to_scheme(preset, targets=["Linear"])
    if calibration is not None:
        scheme.input_activations = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="tensor",
                                                    dynamic=False)
    quantized = sorted(n for n in source.shapes if _PROJECTION.match(n) and len(source.shapes[n]) == 2)
    if scheme.weights.strategy == "group":
        scheme.weights.group_size = _group_size([source.shapes[n][1] for n in quantized], scheme.weights.group_size)
    kept = sorted(set(source.shapes) - set(quantized))
    outputs: list[tuple[str, torch.dtype, tuple[int, ...], str]] = []
    for name in quantized:
        outputs += _compressed_entries(name, source.shapes[name], source.dtypes[name], scheme)
        if calibration is not None:
            outputs.append((name.removesuffix(".weight") + ".input_scale", source.dtypes[name], (1,), name))
    outputs += [(n, source.dtypes[n], source.shapes[n], n) for n in kept]
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"], format=fmt,
                                quantization_status=QuantizationStatus.COMPRESSED).to_dict()
    return Int8Plan(scheme_name, scheme, quantized, kept, _split(outputs), config, list(calibration or []),
                    calibration_origin)


def _group_size(in_features: list[int], preferred: int) -> int:
    """The preset's group size, or the largest power of two below it that divides every projection's input width."""
    size = preferred
    while size >= 16:
        if all(n % size == 0 for n in in_features):
            return size
        size //= 2
    raise UserError("int8 w4a16: the model's projection widths share no group size of 16 or more; use w8a8")


def _compressed_entries(name: str, shape: tuple[int, ...], dtype: torch.dtype,
                        scheme: Any) -> list[tuple[str, torch.dtype, tuple[int, ...], str]]:
    """The tensors the library's compressor makes of one weight (shapes from a meta run of it)."""
    stem = name.removesuffix(".weight")
    meta = torch.empty(shape, dtype=dtype, device="meta")
    groups = shape[1] // scheme.weights.group_size if scheme.weights.strategy == "group" else 1
    scale = torch.empty((shape[0], groups), dtype=dtype, device="meta")
    compressed = _compressor(scheme).compress({"weight": meta, "weight_scale": scale}, scheme)
    return [(f"{stem}.{key}", torch.int64, (len(shape),), name) if key == "weight_shape"
            else (f"{stem}.{key}", value.dtype, tuple(value.shape), name) for key, value in compressed.items()]


def _compressor(scheme: Any) -> Any:
    from compressed_tensors.compressors.naive_quantized.base import IntQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    return PackedQuantizationCompressor if scheme.weights.num_bits == 4 else IntQuantizationCompressor


def quantize_weight(weight: torch.Tensor, scheme: Any) -> dict[str, torch.Tensor]:
    """One weight compressed by the library: scales from each row's (or group's) range, stored in the weight's
    dtype and used as stored, so dequantizing the file gives what was quantized."""
    from compressed_tensors.quantization.utils import calculate_qparams

    w = weight.to(torch.float32)
    rows = w.reshape(w.shape[0], -1, scheme.weights.group_size) if scheme.weights.strategy == "group" else \
        w.reshape(w.shape[0], 1, -1)
    scale, _ = calculate_qparams(rows.amin(dim=-1), rows.amax(dim=-1), scheme.weights)
    scale = scale.to(weight.dtype)
    state = {"weight": w, "weight_scale": scale.to(torch.float32)}
    compressed = _compressor(scheme).compress(state, scheme)
    compressed["weight_scale"] = scale
    return compressed


def _split(entries: list[tuple[str, torch.dtype, tuple[int, ...], str]]) -> list[list[Any]]:
    """Files of at most ``_MAX_FILE`` bytes (one tensor more where one alone is larger); the tensors made of one
    weight always share a file."""
    groups: dict[str, list[Any]] = {}
    for entry in entries:
        groups.setdefault(entry[3], []).append(entry)
    files = in_groups(groups.values(), lambda group: sum(math.prod(e[2]) * e[1].itemsize for e in group), _MAX_FILE)
    return [[entry for group in file for entry in group] for file in files] or [[]]


def write_int8(source: ModelSource, plan: Int8Plan, out: Path, *, progress: bool = True) -> dict[str, Any]:
    """Write ``plan`` of ``source`` as a folder at ``out`` (replacing an earlier one); returns bytes and seconds."""
    from automodel_ckpt.export.plan import progress_bar

    out = Path(out)
    if out.exists() and not HFFolder(out).config.is_file():
        raise UserError(f"output folder {out} exists and is not an earlier export; remove it or choose another")
    start = time.perf_counter()
    ranges: dict[str, float] = {}
    if plan.calibration:
        from automodel_ckpt.export.int8_calibrate import input_ranges

        ranges = input_ranges(source, plan.quantized, plan.calibration)
    tmp = tmp_sibling(out, secrets.token_hex(4))
    tmp.mkdir(parents=True)
    try:
        names = [HFFolder.single_weights] if len(plan.files) == 1 else \
            [HFFolder.weights_name(k + 1, len(plan.files)) for k in range(len(plan.files))]
        with progress_bar(plan.nbytes, progress, "writing int8") as advance:
            for name, entries in zip(names, plan.files):
                _write_file(tmp / name, entries, source, plan.scheme, advance, ranges)
        if len(names) > 1:
            weight_map = {e[0]: n for n, f in zip(names, plan.files) for e in f}
            index = {"metadata": {"total_size": plan.nbytes}, "weight_map": dict(sorted(weight_map.items()))}
            HFFolder(tmp).index.write_text(json.dumps(index, indent=2) + "\n")
        _side_files(source, plan, tmp)
        replace_folder(tmp, out, old_sibling(out, secrets.token_hex(4)).name)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    total = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    return {"bytes": total, "seconds": time.perf_counter() - start}


def _write_file(path: Path, entries: list[Any], source: ModelSource, scheme: Any, advance: Any,
                ranges: dict[str, float]) -> None:
    out = OutFile(path.name, [OutTensor(SourceTensor(n, s, d), d) for n, d, s, _ in entries])
    out.lay_out()  # in safetensors' order, each tensor at its offset
    placed = {t.name: t for t in out.tensors}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.ftruncate(fd, out.size)
        pwrite_all(fd, out.header, 0)
        done: set[str] = set()
        for n, _, _, src in entries:
            if src in done or n in done:
                continue
            if n == src:  # kept as it is
                _put(fd, placed[n], source.read(src), advance)
                done.add(n)
                continue
            compressed = quantize_weight(source.read(src), scheme)  # every tensor made of this weight, at once
            if src in ranges:
                from automodel_ckpt.export.int8_calibrate import input_scale

                compressed["input_scale"] = input_scale(ranges[src], scheme.input_activations, source.dtypes[src])
            stem = src.removesuffix(".weight")
            for key, value in compressed.items():
                _put(fd, placed[f"{stem}.{key}"], value, advance)
                done.add(f"{stem}.{key}")
            done.add(src)
        os.fsync(fd)
    except OSError as exc:
        raise CheckpointError(f"cannot write {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def _put(fd: int, t: OutTensor, value: torch.Tensor, advance: Any) -> None:
    if tuple(value.shape) != tuple(t.source.shape):
        raise CheckpointError(f"int8 export: '{t.name}' came out with shape {tuple(value.shape)}, planned "
                              f"{t.source.shape}")
    pwrite_all(fd, bytes_of(value.to(t.dtype)), t.offset)
    advance(t.nbytes)


def _side_files(source: ModelSource, plan: Int8Plan, folder: Path) -> None:
    """config.json with its ``quantization_config``; the generation config and tokenizer files as they are."""
    config = dict(source.config)
    config["quantization_config"] = plan.config
    write_json(HFFolder(folder).config, config)
    for name in (HFFolder.generation_config, *HFFolder.TOKENIZER_FILES):
        if (source.side_dir / name).is_file():  # side_dir: the source's files, checked and copied privately
            copy_regular(source.side_dir / name, folder / name)
