"""The model behind an export SRC (a checkpoint, a Hugging Face folder or an archive), read one tensor at a time.

``open_model(src)`` gives the tensors ``save_pretrained`` would write, under their on-disk names, without writing a
Hugging Face folder first: a checkpoint's through the export's own plan, a folder's and an archive's by positioned
reads, one tensor in memory at a time. The small files (config, tokenizer) are copied into ``side_dir``, a private
temporary folder, so no library reading them meets a link; a folder's files are read only as ``model_file_in``
allows. A LoRA checkpoint is merged into its base first, which holds the model in memory, as `merge-lora` does.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from automodel_ckpt.ondisk import (CONFIG_FILE_LIMIT, COUNT_LIMIT, INDEX_FILE_LIMIT, ST_TO_TORCH, Archive, HFFolder,
                                   ModelFolder, check_size, copy_regular, model_file_in, open_regular, pread_into,
                                   read_header, read_json, tensor_entries)
from automodel_ckpt.errors import CheckpointError, UserError, first_line


@dataclass
class ModelSource:
    """A model's tensors by on-disk name (shape, dtype, and how to read it), the folder of its small files, and for a
    quantized one each tensor's rounding: what the exports read and ``diff``, ``average`` and ``eval`` compare."""

    config: dict[str, Any]
    side_dir: Path | None = None  # a private folder holding copies of its small files (config, tokenizer)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    readers: dict[str, Callable[[], torch.Tensor]] = field(default_factory=dict)
    saved: dict[str, Callable[[], torch.Tensor]] = field(default_factory=dict)  # a checkpoint's, before the cast
    #: a quantized tensor's rounding: each element's step, given the tensor as read (an int8 folder dequantized:
    #: ``int8_read``; a quantized file's)
    steps: dict[str, Callable[[torch.Tensor], torch.Tensor]] = field(default_factory=dict)
    formats: dict[str, str] = field(default_factory=dict)  # how a quantized tensor is stored (format and type)
    kind: str = "export"  # what it is: "checkpoint", "archive", "adapter" (a LoRA adapter's own tensors), ...
    name: str = ""  # what the model is called (the SRC's name), as a quantized file records it
    where: str = ""  # the SRC as the user gave it (for messages)
    side: dict[str, bytes] = field(default_factory=dict)  # its small files' bytes by name, where a reader took them

    def add(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, read: Callable[[], torch.Tensor]) -> None:
        self.shapes[name], self.dtypes[name], self.readers[name] = tuple(shape), dtype, read

    def read(self, name: str) -> torch.Tensor:
        """The tensor ``name``, read now (the caller holds the only reference)."""
        return self.readers[name]()

    def read_saved(self, name: str) -> torch.Tensor:
        """The tensor ``name`` in the dtype it was saved in (a checkpoint's float32 training weights, where ``read``
        gives the export's dtype, the base's); a folder's or an archive's as ``read`` gives it."""
        return self.saved.get(name, self.readers[name])()

    def rounding(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """Each element's rounding in this model's format: a quantized tensor's step, else half a unit in the last
        place of ``dtypes[name]`` (the dtype an export reads: a checkpoint's is the base's)."""
        if name in self.steps:
            return self.steps[name](value)
        dtype = self.dtypes[name]
        if not dtype.is_floating_point:
            return torch.zeros((), dtype=torch.float64)
        return value.double().abs() * (torch.finfo(dtype).eps / 2)

    @property
    def nbytes(self) -> int:
        return sum(math.prod(s) * self.dtypes[n].itemsize for n, s in self.shapes.items())


_LAYER = re.compile(r"^(?:model\.layers|transformer\.h|model\.language_model\.layers)\.(\d+)\.")


def layer_count(config: dict[str, Any], shapes: dict[str, tuple[int, ...]], whose: str) -> int:
    """The layer count of ``config`` (``num_hidden_layers``, GPT-2's ``n_layer``), checked against the layers in
    ``shapes`` before anything loops over it: a crafted ``config.json`` never sizes a loop or a table."""
    key = "n_layer" if "n_layer" in config and "num_hidden_layers" not in config else "num_hidden_layers"
    value = config.get(key)
    present = {int(m.group(1)) for m in map(_LAYER.match, shapes) if m}
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CheckpointError(f"{whose}: config.json's {key} is {str(value)[:40]}, not a number of layers")
    if value != len(present) or (present and max(present) != value - 1):  # layers 0 .. value-1, none missing
        raise CheckpointError(f"{whose}: config.json's {key} is {value}, but the weight files hold "
                              f"{len(present)} layer(s)" + (f" (numbered up to {max(present)})" if present else ""))
    return value


@contextmanager
def open_model(src: Path) -> Iterator[ModelSource]:
    """The model of ``src``: a checkpoint folder (``epoch_E_step_N`` or its ``model/``), a Hugging Face folder
    (``config.json`` and safetensors files) or an archive written by ``ckpt-train pack``."""
    src = Path(src)
    with ExitStack() as stack:
        if src.is_file():
            source = _from_archive(src, stack)
        elif not src.is_dir():
            raise UserError(f"'{src}' does not exist; give a checkpoint, an export folder or an archive")
        elif HFFolder(src).config.is_file() and any(src.glob("*.safetensors")):
            source = _from_folder(src, stack)
        else:
            source = _from_checkpoint(src, stack)
        source.name, source.where = src.resolve().name.removesuffix(Archive.SUFFIX), str(src)
        yield source


# --- a checkpoint ------------------------------------------------------------------------------------------------
def _from_checkpoint(src: Path, stack: ExitStack) -> ModelSource:
    from automodel_ckpt.export.plan import build_plan, resolve_model_dir

    model_dir = resolve_model_dir(src)
    if HFFolder(model_dir).adapter_config.is_file() or HFFolder(src).adapter_config.is_file():
        from automodel_ckpt.export.lora_merge import merge_lora

        tmp = _tmp_dir(stack)
        merged = merge_lora(src, tmp / "merged")  # a LoRA checkpoint: its adapter merged into its base
        source = _from_folder(merged, stack, side=merged)
        source.kind = "LoRA checkpoint (merged)"
        return source
    plan = build_plan(model_dir, None, COUNT_LIMIT)  # shards of any size: the plan here only reads
    if plan.config is None:
        raise CheckpointError(f"{model_dir} has no {ModelFolder.hf_metadata} (no config.json): its family is unknown, "
                              "so it cannot be exported to a quantized format")
    side = _tmp_dir(stack)
    HFFolder(side).config.write_text(json.dumps(plan.config))
    for path in plan.extra_files:
        try:
            copy_regular(path, side / path.name)
        except OSError as exc:  # unreadable, or replaced since the plan passed it
            raise CheckpointError(f"cannot read '{path}': {exc.strerror or first_line(exc)}") from None
    source = ModelSource(plan.config, side, kind="checkpoint")
    for f in plan.files:
        for t in f.tensors:  # in the Hugging Face export's dtype (the base's), so both make the same file
            source.add(t.name, t.source.shape, t.dtype, lambda s=t.source, d=t.dtype: _assemble(s).to(d))
            source.saved[t.name] = lambda s=t.source: _assemble(s)
    return source


def _assemble(tensor: Any) -> torch.Tensor:
    """A tensor of a checkpoint built from its shard pieces (a strided view of a saved tensor taken after)."""
    from automodel_ckpt.export.sources import read_full

    return read_full(tensor).contiguous()


# --- a Hugging Face folder ---------------------------------------------------------------------------------------
_REFUSAL = ("an export reads only a model folder's regular files (and a cache snapshot's links into its own "
            "blobs/), never what another link points to: replace it with the file itself")
_SIDE_FILE_LIMIT = 4 * INDEX_FILE_LIMIT  # bytes of one small file of a folder (config, tokenizer) copied


def _from_folder(folder: Path, stack: ExitStack, side: Path | None = None) -> ModelSource:
    """The model of a Hugging Face folder the user named, its small files copied into a private ``side_dir`` first
    (module docstring). ``side``: a folder this process wrote itself (a merged LoRA), used as it is."""
    if side is None:
        side = _tmp_dir(stack)
        for name in (HFFolder.config, HFFolder.generation_config, *HFFolder.TOKENIZER_FILES):
            try:
                path = model_file_in(folder, name, _REFUSAL)
                check_size(os.stat(path).st_size, f"'{folder / name}'", "a model folder's small file", _SIDE_FILE_LIMIT)
                copy_regular(path, side / name)
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise CheckpointError(f"cannot read '{folder / name}': {exc.strerror or exc}") from None
    config = read_json(HFFolder(side).config, "a model config", CONFIG_FILE_LIMIT)
    if not isinstance(config, dict):
        raise CheckpointError(f"{HFFolder(folder).config} is not a JSON object")
    source = ModelSource(config, side)
    for name in sorted(p.name for p in folder.glob("*.safetensors")):
        path = folder / name
        try:
            real = model_file_in(folder, name, _REFUSAL)  # itself, or the cache blob it leads to
            fd = open_regular(real)
        except OSError as exc:
            raise CheckpointError(f"cannot read '{path}': {exc.strerror or exc}") from None
        stack.callback(os.close, fd)
        header, data_start = read_header(real)
        _add_entries(source, header, lambda at, n, fd=fd, path=path: _pread(fd, at, n, path), data_start, str(path))
    return source


def _add_entries(source: ModelSource, header: dict[str, Any], read: Callable[[int, int], bytearray], data_start: int,
                 where: str) -> None:
    for name, entry in tensor_entries(header).items():
        dtype = ST_TO_TORCH.get(entry.get("dtype"))
        if dtype is None:
            raise CheckpointError(f"{where}: tensor '{name}' has dtype {entry.get('dtype')}, which is not exported")
        shape = tuple(int(d) for d in entry["shape"])
        begin, end = (int(x) for x in entry["data_offsets"])
        if name in source.shapes:
            raise CheckpointError(f"{where}: tensor '{name}' is in two weight files")

        def load(begin: int = begin, end: int = end, shape: tuple[int, ...] = shape,
                 dtype: torch.dtype = dtype) -> torch.Tensor:
            buf = read(data_start + begin, end - begin)
            return torch.frombuffer(buf, dtype=dtype).view(shape) if buf else torch.empty(shape, dtype=dtype)

        source.add(name, shape, dtype, load)


def _pread(fd: int, at: int, n: int, path: Path) -> bytearray:
    buf = bytearray(n)
    if n:
        pread_into(fd, memoryview(buf), at, path)
    return buf


# --- an archive --------------------------------------------------------------------------------------------------
def _from_archive(path: Path, stack: ExitStack) -> ModelSource:
    from automodel_ckpt.export.archive import is_archive, open_archive

    if not is_archive(path):
        raise UserError(f"'{path}' is a file but not an archive of `ckpt-train pack`; give a checkpoint, an export "
                        "folder or an archive")
    archive = stack.enter_context(open_archive(path))
    if HFFolder.adapter_config in archive.members:
        raise UserError(f"the archive '{path}' holds a LoRA adapter; export its checkpoint, or `ckpt-train "
                        "merge-lora` it first")
    side = _tmp_dir(stack)
    for name in (HFFolder.config, HFFolder.generation_config, *HFFolder.TOKENIZER_FILES):
        if name in archive.members:
            (side / name).write_bytes(archive.read(name, "a model folder's small file", INDEX_FILE_LIMIT))
    if not HFFolder(side).config.is_file():
        raise CheckpointError(f"the archive '{path}' has no {HFFolder.config}")
    config = read_json(HFFolder(side).config, "a model config", CONFIG_FILE_LIMIT)
    source = ModelSource(config if isinstance(config, dict) else {}, side, kind="archive")
    for name in sorted(n for n in archive.members if n.endswith(".safetensors") and "/" not in n):
        header, data_start = archive.safetensors_header(name)
        member = archive.member(name)
        _add_entries(source, header, lambda at, n, m=member: _pread(archive.fd, m.offset + at, n, path),
                     data_start, archive.where(name))
    return source


def _tmp_dir(stack: ExitStack) -> Path:
    return Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ckpt-export-")))
