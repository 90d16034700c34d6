"""The hidden ``model/.hf_metadata/`` folder: what a Hugging Face export needs besides the weights.

Captured at save time, so that an export later (elsewhere, without the base model) is faithful to the base: its
configs, tokenizer, and each tensor's original dtype and file, from the base's safetensors *headers* only; the
files' formats are in docs/consolidation.md.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from automodel_ckpt.ondisk import (INDEX_FILE_LIMIT, MAX_WORLD_SIZE, HFFolder, ModelFolder, check_count, check_path,
                                   copy_regular, read_header, read_json, remove_tree, st_dtype_name, tensor_entries,
                                   walk_regular, write_json)
from automodel_ckpt.errors import CheckpointError, first_line

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1


@dataclass(frozen=True)
class TensorInfo:
    """A tensor's dtype (safetensors name, e.g. ``"BF16"``), full shape and, for base tensors, its file (1-based)."""

    dtype: str
    shape: tuple[int, ...]
    file: int | None = None


@dataclass
class HFMetadata:
    """Contents of ``.hf_metadata``; ``original`` is None when the base model was built from a config."""

    folder: Path
    config: dict[str, Any] | None
    original: dict[str, TensorInfo] | None = None
    original_num_files: int | None = None
    saved: dict[str, TensorInfo] | None = None
    """Full shape and dtype of every saved tensor, when the state dict was given at save time."""
    saved_world_size: int | None = None
    """Number of ranks that wrote the shards: each must have left its shard file."""
    extra_files: list[Path] = field(default_factory=list)
    """Files copied verbatim into an export: generation config, tokenizer files, chat template, ..."""


def write_hf_metadata(
    model_dir: Path,
    *,
    hf_config: Any,
    generation_config: Any = None,
    tokenizer: Any = None,
    base_model_path: Path | None = None,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    world_size: int | None = None,
) -> None:
    """Write ``model_dir/.hf_metadata/`` (replacing an existing one).

    ``hf_config``/``generation_config``: transformers configs or dicts; ``tokenizer``: anything with
    ``save_pretrained``; missing ones are copied from the base folder. ``world_size`` (default: the process
    group's) is recorded because a missing *last* shard file is invisible in the others; ``state_dict`` (DTensors
    allowed) records every tensor's full shape and dtype, which makes the coverage check exact."""
    model_dir = Path(model_dir)
    meta_dir = ModelFolder(model_dir).hf_metadata
    folder = meta_dir.path
    remove_tree(folder)
    folder.mkdir(parents=True)
    if hf_config is not None:
        _save_config(hf_config, folder, HFFolder.config)
    else:
        logger.warning("no model config given; an export of %s will lack %s", model_dir, HFFolder.config)
    base = Path(base_model_path) if base_model_path is not None else None
    if base is not None and not base.is_dir():
        logger.info("base model path %s is not a local folder; no original tensor information recorded", base)
        base = None
    if generation_config is not None:
        _save_config(generation_config, folder, HFFolder.generation_config)
    elif base is not None and HFFolder(base).generation_config.is_file():
        _copy_from_base(HFFolder(base).generation_config, folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))
    elif base is not None:
        for name in HFFolder.TOKENIZER_FILES:
            if (base / name).is_file():
                _copy_from_base(base / name, folder)
    if base is not None:
        original = original_tensors(base)
        if original is None:
            logger.info("base model %s has no safetensors weights; no original tensor information recorded", base)
        else:
            write_json(meta_dir.original_tensors, original)
    if world_size is None and torch.distributed.is_available() and torch.distributed.is_initialized():
        world_size = torch.distributed.get_world_size()
    saved = None
    if state_dict is not None:
        saved = {name: {"dtype": st_dtype_name(t.dtype), "shape": list(t.shape)}
                 for name, t in state_dict.items() if isinstance(t, torch.Tensor)}
    state = {"format_version": FORMAT_VERSION, "world_size": world_size, "tensors": saved}
    write_json(meta_dir.saved_state, state)


def read_hf_metadata(model_dir: Path) -> HFMetadata:
    """Read ``model_dir/.hf_metadata``; a missing folder is a CheckpointError."""
    meta_dir = ModelFolder(model_dir).hf_metadata
    folder = meta_dir.path
    if folder.is_symlink():
        raise CheckpointError(f"'{folder}' is a symlink, not a folder; folders inside a checkpoint are never "
                              "followed as links")
    if not folder.is_dir():
        raise CheckpointError(f"no {ModelFolder.hf_metadata} folder in {model_dir}")
    config_path = meta_dir.config
    config = _read_json(config_path) if os.path.lexists(config_path) else None
    meta = HFMetadata(folder=folder, config=config)
    if config is not None and not isinstance(config, dict):
        raise CheckpointError(f"damaged {config_path}: not a JSON object")
    original_path, saved_path = meta_dir.original_tensors, meta_dir.saved_state
    try:
        if os.path.lexists(original_path):
            data = _read_json(original_path)
            meta.original = {name: _tensor_info(name, v, original_path) for name, v in data["tensors"].items()}
            meta.original_num_files = check_count(data["num_files"], str(original_path), "num_files",
                                                  max(1, len(meta.original)))
        if os.path.lexists(saved_path):
            data = _read_json(saved_path)
            if data.get("tensors") is not None:
                meta.saved = {name: _tensor_info(name, v, saved_path) for name, v in data["tensors"].items()}
            if data.get("world_size"):
                meta.saved_world_size = check_count(data["world_size"], str(saved_path), "world_size", MAX_WORLD_SIZE)
    except (KeyError, TypeError, ValueError, AttributeError):
        raise CheckpointError(f"damaged {folder}: {original_path.name} or {saved_path.name} "
                              "lacks its 'tensors' table") from None
    meta.extra_files = _side_files(folder, {config_path.name, original_path.name, saved_path.name})
    return meta


def _side_files(folder: Path, skip: set[str]) -> list[Path]:
    """The regular files of ``.hf_metadata`` an export copies (not ``skip``, which describe the model); a link,
    FIFO, socket or device there is refused in one line, and so is a folder named as a model folder's file."""
    passed: list[tuple[str, str]] = []
    try:
        files = [folder / rel for rel, _ in walk_regular(folder, passed) if "/" not in rel and rel not in skip]
    except OSError as exc:
        raise CheckpointError(f"cannot read the folder '{folder}': {exc.strerror or exc}") from None
    passed = [(rel, why) for rel, why in passed if "/" not in rel]
    passed += [(name, "a folder, not a regular file") for name in (HFFolder.generation_config,
                                                                   *HFFolder.TOKENIZER_FILES)
               if (folder / name).is_dir() and not (folder / name).is_symlink()]
    if passed:
        rel, why = passed[0]
        raise CheckpointError(f"'{folder / rel}' is {why}; an export copies only regular files from "
                              f"{ModelFolder.hf_metadata}: replace it with the file itself or remove it")
    return files


def _copy_from_base(source: Path, folder: Path) -> None:
    """Copy a file of the base folder the recipe names (links followed: an HF cache is links into its blobs) into
    ``folder``; a FIFO or device there is refused (``CheckpointError``)."""
    try:
        copy_regular(source, folder / source.name, follow=True)
    except OSError as exc:
        raise CheckpointError(f"cannot copy '{source}' from the base model folder: {first_line(exc)}") from None


def original_tensors(base: Path) -> dict[str, Any] | None:
    """Per-tensor dtype, shape and file number of a base HF folder, from its index and safetensors headers; None
    when it has no safetensors weights."""
    files = weight_files(base)
    if files is None:
        return None
    tensors: dict[str, dict[str, Any]] = {}
    for number, name in enumerate(files, start=1):
        header, _ = read_header(base / name)
        for fqn, entry in tensor_entries(header).items():
            tensors[fqn] = {"dtype": entry["dtype"], "shape": list(entry["shape"]), "file": number}
    return {"format_version": FORMAT_VERSION, "num_files": len(files), "files": files, "tensors": tensors}


def weight_files(base: Path) -> list[str] | None:
    """The safetensors files of a Hugging Face folder: those its index names (each a plain name), else its one
    ``model.safetensors``; None when it has neither."""
    index = HFFolder(base).index
    if index.is_file():
        weight_map = _read_json(index, follow=True)
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"'{index}' has no 'weight_map' table")
        return sorted({check_path(f, f"'{index}'") for f in weight_map.values()})
    return [HFFolder.single_weights] if HFFolder(base).single_weights.is_file() else None


def _tensor_info(name: str, value: Mapping[str, Any], source: Path) -> TensorInfo:
    try:
        file = value.get("file")
        return TensorInfo(str(value["dtype"]), tuple(int(d) for d in value["shape"]), int(file) if file else None)
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"damaged {source}: bad entry for '{name}'") from None


def _save_config(config: Any, folder: Path, filename: str) -> None:
    if isinstance(config, Mapping):
        write_json(folder / filename, dict(config))
    elif hasattr(config, "to_json_file"):
        config.to_json_file(str(folder / filename))
    else:
        raise TypeError(f"expected a transformers config or a dict for {filename}, got {type(config).__name__}")


def _read_json(path: Path, *, follow: bool = False) -> Any:
    """JSON of a checkpoint's file (never through a link), or with ``follow`` of the base folder the recipe names."""
    try:
        return read_json(path, "export metadata", INDEX_FILE_LIMIT, follow=follow)
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
