"""A Hugging Face model or adapter folder written tensor by tensor: one tensor in memory at a time, atomic by rename.

Every tensor's name, shape and dtype is known first, so each safetensors header is written before its tensors, each
produced, written and dropped. The files are the consolidate export's (``config.json``'s ``dtype`` the one written);
the folder is written into a hidden sibling and renamed into place when complete.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from automodel_ckpt.errors import UserError
from automodel_ckpt.ondisk import HFFolder, encode_header, fsync_file, st_dtype_name, tmp_sibling
from automodel_ckpt.sizes import in_groups

__all__ = ["Entry", "write_folder"]

Entry = tuple[str, tuple[int, ...], torch.dtype]  # name, shape, dtype of one tensor to write
_DEFAULT_SHARD = 5 * 2**30


def write_folder(out: Path, entries: list[Entry], produce: Callable[[str], torch.Tensor], side: dict[str, bytes], *,
                 adapter: bool = False, max_shard_size: int = _DEFAULT_SHARD) -> Path:
    """Write ``entries`` (each tensor from ``produce``) and the small files ``side`` into the new folder ``out``."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"'{out}' exists and is not empty; choose another --out or remove it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_sibling(out, secrets.token_hex(4))
    tmp.mkdir()
    try:
        files = _files(entries, adapter, max_shard_size)
        for name, content in side.items():
            if name == HFFolder.config and not adapter:
                content = _config_with_dtype(content, entries)
            _write_bytes(tmp / name, content)
        for file_name, group in files:
            _write_safetensors(tmp / file_name, group, produce)
        if not adapter:
            weight_map = {name: file_name for file_name, group in files for name, _, _ in group}
            total = sum(_nbytes(shape, dtype) for _, shape, dtype in entries)
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            _write_bytes(HFFolder(tmp).index, (json.dumps(index, indent=2, sort_keys=True) + "\n").encode())
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _files(entries: list[Entry], adapter: bool, max_shard_size: int) -> list[tuple[str, list[Entry]]]:
    if adapter:
        return [(HFFolder.adapter_weights, list(entries))]
    groups = in_groups(entries, lambda entry: _nbytes(entry[1], entry[2]), max_shard_size) or [[]]
    return [(HFFolder.weights_name(k + 1, len(groups)), group) for k, group in enumerate(groups)]


def _write_safetensors(path: Path, group: list[Entry], produce: Callable[[str], torch.Tensor]) -> None:
    header = encode_header([(name, st_dtype_name(dtype), shape, _nbytes(shape, dtype)) for name, shape, dtype in group],
                           {"format": "pt"})
    with open(path, "xb") as f:
        f.write(header)
        for name, shape, dtype in group:
            tensor = produce(name)
            if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
                raise RuntimeError(f"tensor {name}: produced {tuple(tensor.shape)} {tensor.dtype}, planned "
                                   f"{tuple(shape)} {dtype}")
            if tensor.numel():
                f.write(tensor.contiguous().view(-1).view(torch.uint8).numpy().data)
            del tensor
        f.flush()
        os.fsync(f.fileno())


def _write_bytes(path: Path, content: bytes) -> None:
    with open(path, "xb") as f:
        f.write(content)
    fsync_file(path)


def _config_with_dtype(content: bytes, entries: list[Entry]) -> bytes:
    """``config.json`` with ``dtype`` saying the floating dtype most bytes are written in (as the export's)."""
    config = json.loads(content)
    sizes: dict[torch.dtype, int] = {}
    for _, shape, dtype in entries:
        if dtype.is_floating_point:
            sizes[dtype] = sizes.get(dtype, 0) + _nbytes(shape, dtype)
    if isinstance(config, dict) and sizes:
        name = str(max(sizes, key=sizes.__getitem__)).removeprefix("torch.")
        config["dtype"] = name
        if "torch_dtype" in config:
            config["torch_dtype"] = name
    return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(int(d) for d in shape) * dtype.itemsize
