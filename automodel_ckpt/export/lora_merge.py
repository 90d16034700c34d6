"""Fold a PEFT checkpoint's LoRA adapter into its base, as a full Hugging Face model.

The base is loaded in float32, the adapter merged with PEFT (``merge_and_unload``), and every tensor cast back to its
dtype in the base's own files, so the merged folder is as large and as loadable as the base. It is written beside
``out`` and renamed into place; inside a checkpoint, the manifest then lists the new files.

The adapter folder is untrusted: its files are read only as regular files, never through a link. A base folder may
be a cache snapshot (links into ``blobs/``): named with ``--base``, its links are followed; named by
``adapter_config.json``, only links that stay inside that repository.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

import torch

from automodel_ckpt.ondisk import (SMALL_FILE_LIMIT, ST_TO_TORCH, Archive, CheckpointFolder, HFFolder, ModelFolder,
                                   add_files_to_manifest, auto_model_class, copy_regular, in_memory_dtypes,
                                   old_sibling, read_json, regular_file_problem, replace_folder, tmp_sibling,
                                   write_json)
from automodel_ckpt.errors import CheckpointError, first_line
from automodel_ckpt.export.hf_metadata import original_tensors


def adapter_folder(path: Path) -> Path:
    """The PEFT adapter folder of a checkpoint (``CHECKPOINT/model``) or the folder itself."""
    path = Path(path)
    for candidate in (CheckpointFolder(path).model.path, path):
        if candidate is not path and candidate.is_symlink():
            raise CheckpointError(f"'{candidate}' is a symlink, not a folder; folders inside a checkpoint are never "
                                  "followed as links")
        if os.path.lexists(HFFolder(candidate).adapter_config):
            return candidate
    if not path.exists():
        raise CheckpointError(f"'{path}' not found")
    raise CheckpointError(f"'{path}' holds no {HFFolder.adapter_config}: not a PEFT checkpoint "
                          "(full fine-tuning checkpoints are exported with `ckpt-train consolidate`)")


def base_model_folder(adapter_dir: Path, override: Path | None = None) -> Path:
    """The local base model folder: ``override``, else ``base_model_name_or_path`` of ``adapter_config.json``."""
    config = None
    if override is None:
        try:
            config = read_json(HFFolder(adapter_dir).adapter_config, "an adapter config", SMALL_FILE_LIMIT)
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"cannot read {HFFolder(adapter_dir).adapter_config}: {first_line(exc)}") from None
    return _base_folder(config, str(HFFolder(adapter_dir).adapter_config), override)


def _base_folder(config: Any, where: str, override: Path | None) -> Path:
    """``override``, else the folder an adapter config (read from ``where``) names; it must hold a config."""
    if override is not None:
        base = Path(override)
    else:
        name = config.get("base_model_name_or_path") if isinstance(config, dict) else None
        if not name:
            raise CheckpointError(f"{where} names no base model; pass --base DIR")
        base = Path(name)
    if not HFFolder(base).config.is_file():
        raise CheckpointError(f"base model folder '{base}' not found (or it has no {HFFolder.config}); "
                              "pass --base DIR with the base model the adapter was trained on")
    return base


def original_dtypes(base: Path) -> dict[str, torch.dtype]:
    """Each tensor's dtype in the base folder's safetensors files (read from their headers only)."""
    tensors = (original_tensors(base) or {"tensors": {}})["tensors"]
    return {fqn: ST_TO_TORCH[entry["dtype"]] for fqn, entry in tensors.items() if entry["dtype"] in ST_TO_TORCH}


def merged_model(adapter_dir: Path, base: Path) -> Any:
    """Base + adapter merged in float32, then cast tensor by tensor to the base's stored dtypes."""
    from peft import PeftModel

    model = auto_model_class(base).from_pretrained(str(base), dtype=torch.float32)
    return _stored_dtypes(PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload(), base)


def _merged_from_archive(config: dict[str, Any], weights: dict[str, torch.Tensor], base: Path) -> Any:
    """Base + an archived adapter (its config and tensors, read in place) merged, as ``merged_model``."""
    from peft import PeftConfig, PeftModel, set_peft_model_state_dict

    model = auto_model_class(base).from_pretrained(str(base), dtype=torch.float32)
    peft_model = PeftModel(model, PeftConfig.from_peft_type(**config))
    result = set_peft_model_state_dict(peft_model, weights)
    if getattr(result, "unexpected_keys", None):
        raise CheckpointError(f"the archived adapter holds tensors the model has no place for (e.g. "
                              f"'{result.unexpected_keys[0]}'): another base model? pass --base DIR")
    return _stored_dtypes(peft_model.merge_and_unload(), base)


def _stored_dtypes(merged: Any, base: Path) -> Any:
    """Every tensor of ``merged`` cast to the dtype it has in the base's own files."""
    dtypes = in_memory_dtypes(merged, original_dtypes(base))  # on-disk names -> the model's in-memory names
    with torch.no_grad():
        for name, tensor in list(merged.named_parameters()) + list(merged.named_buffers()):
            want = dtypes.get(name)
            if want is not None and tensor.is_floating_point() and tensor.dtype != want:
                tensor.data = tensor.data.to(want)
    stored = {d for d in dtypes.values() if d.is_floating_point}
    if len(stored) == 1:
        merged.config.dtype = next(iter(stored))
    return merged


def merge_lora(checkpoint: Path, out: Path | None = None, base: Path | None = None) -> Path:
    """Write the merged model of a PEFT checkpoint to ``out`` (default ``CHECKPOINT/model/merged``); an archived
    adapter (``ckpt-train pack``) is read in place (default ``out``: ``NAME-merged`` beside ``NAME.tar``)."""
    from automodel_ckpt.export.archive import is_archive

    if is_archive(Path(checkpoint)):
        return _merge_archive(Path(checkpoint), out, base)
    adapter_dir = adapter_folder(checkpoint)
    for name in (HFFolder.adapter_config, HFFolder.adapter_weights, HFFolder.adapter_weights_pickle):
        _refuse_unless_regular(adapter_dir / name, "the adapter folder")  # before they are read
    base_dir = base_model_folder(adapter_dir, base)
    out = Path(out) if out is not None else ModelFolder(adapter_dir).merged.path
    own_tokenizer = os.path.lexists(HFFolder(adapter_dir).tokenizer_config)
    side_files = _side_files(adapter_dir if own_tokenizer else base_dir, follow=not own_tokenizer,
                             within=None if own_tokenizer or base is not None else _cache_repo(base_dir))
    _write_merged(merged_model(adapter_dir, base_dir), out, side_files, {})
    add_files_to_manifest(out)  # no-op outside a checkpoint
    return out


def _merge_archive(archive_path: Path, out: Path | None, base: Path | None) -> Path:
    """``merge_lora`` of an archived adapter: its config, tensors and tokenizer files read from the archive."""
    from safetensors.torch import load as load_safetensors

    from automodel_ckpt.export.archive import open_archive

    with open_archive(archive_path) as archive:
        if HFFolder.adapter_config not in archive.members or HFFolder.adapter_weights not in archive.members:
            raise CheckpointError(f"the archive '{archive_path}' holds no PEFT adapter ({HFFolder.adapter_config} and "
                                  f"{HFFolder.adapter_weights}); a full model's archive needs no merge")
        config = archive.json(HFFolder.adapter_config, "an adapter config", SMALL_FILE_LIMIT)
        archive.safetensors_header(HFFolder.adapter_weights)  # checked as a file's would be, before it is parsed
        size = archive.member(HFFolder.adapter_weights).size
        weights = load_safetensors(archive.read(HFFolder.adapter_weights, "adapter weights", size))
        tokenizer = {name: archive.read(name, "a tokenizer file", archive.member(name).size)
                     for name in HFFolder.TOKENIZER_FILES if name in archive.members}
    if not isinstance(config, dict):
        raise CheckpointError(f"{HFFolder.adapter_config} of the archive '{archive_path}' is not a JSON object")
    base_dir = _base_folder(config, f"{HFFolder.adapter_config} of the archive '{archive_path}'", base)
    side_files = [] if tokenizer else _side_files(base_dir, follow=True,
                                                  within=None if base is not None else _cache_repo(base_dir))
    name = archive_path.name.removesuffix(Archive.SUFFIX)
    out = Path(out) if out is not None else archive_path.parent / f"{name}-merged"
    _write_merged(_merged_from_archive(config, weights, base_dir), out, side_files, tokenizer)
    return out


def _write_merged(model: Any, out: Path, side_files: list[tuple[Path, bool]], side_bytes: dict[str, bytes]) -> None:
    """The merged model and its tokenizer files (copied, or given as bytes) as ``out``, swapped in when complete."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_sibling(out, secrets.token_hex(4))
    try:
        model.save_pretrained(str(tmp))
        _fix_config_dtype(HFFolder(tmp).config, model.config.dtype)
        for weights in tmp.glob("*.safetensors"):  # written owner-only; as readable as the other files
            shutil.copymode(HFFolder(tmp).config, weights)
        for source, follow in side_files:
            try:
                copy_regular(source, tmp / source.name, follow=follow)
            except OSError as exc:
                raise CheckpointError(f"cannot copy '{source}' into the merged folder: {first_line(exc)}") from None
        for name, data in side_bytes.items():
            (tmp / name).write_bytes(data)
        replace_folder(tmp, out, old_sibling(out, secrets.token_hex(4)).name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _refuse_unless_regular(path: Path, where: str) -> None:
    """A ``CheckpointError`` (one line) when ``path`` exists and is a symlink, FIFO, device or folder."""
    try:
        why = regular_file_problem(path)
    except FileNotFoundError:
        return
    if why is not None:
        raise CheckpointError(f"'{path}' is {why}; files of {where} are read only as regular files, never through "
                              "a link: replace it with the file itself")


def _side_files(source: Path, *, follow: bool, within: Path | None) -> list[tuple[Path, bool]]:
    """The tokenizer files of ``source`` to copy, checked before the merge: an adapter's must be regular files
    (``follow`` False); a base folder's may be links, which with ``within`` must resolve below it."""
    found = []
    for name in HFFolder.TOKENIZER_FILES:
        path = source / name
        if not os.path.lexists(path):
            continue
        if not follow:
            _refuse_unless_regular(path, "the adapter folder")
        elif within is not None and path.is_symlink() and not Path(os.path.realpath(path)).is_relative_to(within):
            raise CheckpointError(f"'{path}' is a symlink leading out of the base model folder '{within}' named by "
                                  f"{HFFolder.adapter_config}; pass --base DIR to use a base folder you trust")
        found.append((path, follow))
    return found


def _cache_repo(base: Path) -> Path:
    """The folder a base's links may lead into: a Hugging Face cache snapshot's repository (``models--org--name``,
    whose ``blobs/`` its links name), else the base folder itself."""
    real = Path(os.path.realpath(base))
    return real.parent.parent if real.parent.name == "snapshots" else real


def _fix_config_dtype(config_file: Path, dtype: Any) -> None:
    """``config.json``'s ``dtype`` is the stored one (save_pretrained may record another)."""
    if not isinstance(dtype, torch.dtype):
        return
    data = json.loads(config_file.read_text(encoding="utf-8"))
    name = str(dtype).removeprefix("torch.")
    if data.get("dtype") != name:
        data["dtype"] = name
        write_json(config_file, data)
