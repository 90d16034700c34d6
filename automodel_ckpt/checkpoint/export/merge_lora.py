"""Fold a PEFT checkpoint's LoRA adapter into its base, as a full Hugging Face model.

The base named in ``adapter_config.json`` is loaded in float32, the adapter applied with PEFT and merged
(``merge_and_unload``: W + scale * B @ A), and every tensor is cast back to the dtype it has in the base's own
safetensors files (bf16 for the embedded base), so the merged folder is as large and as loadable as the base.
``save_pretrained`` writes it in the family's on-disk layout (experts per expert, tied weights once).
The folder is written under a hidden temporary name and renamed into place when complete; inside a checkpoint,
the checkpoint's manifest is updated to list the new files.
"""

from __future__ import annotations

import json
import secrets
import shutil
from pathlib import Path
from typing import Any

import torch

from automodel_ckpt.checkpoint.disk import layout, manifest, paths
from automodel_ckpt.checkpoint.export.family import auto_model_class, in_memory_dtypes
from automodel_ckpt.checkpoint.formats.safetensors_io import ST_TO_TORCH, read_header, tensor_entries
from automodel_ckpt.checkpoint.disk.durable import replace_folder
from automodel_ckpt.errors import CheckpointError


def adapter_folder(path: Path) -> Path:
    """The PEFT adapter folder of a checkpoint (``CHECKPOINT/model``) or the folder itself."""
    path = Path(path)
    for candidate in (path / layout.MODEL_DIR, path):
        if (candidate / layout.ADAPTER_CONFIG).is_file():
            return candidate
    if not path.exists():
        raise CheckpointError(f"'{path}' not found")
    raise CheckpointError(f"'{path}' holds no {layout.ADAPTER_CONFIG}: not a PEFT checkpoint "
                          "(full fine-tuning checkpoints are exported with `ckpt-train consolidate`)")


def base_model_folder(adapter_dir: Path, override: Path | None = None) -> Path:
    """The local base model folder: ``override``, else ``base_model_name_or_path`` of ``adapter_config.json``."""
    if override is not None:
        base = Path(override)
    else:
        try:
            config = json.loads((adapter_dir / layout.ADAPTER_CONFIG).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"cannot read {adapter_dir / layout.ADAPTER_CONFIG}: {exc}") from None
        name = config.get("base_model_name_or_path")
        if not name:
            raise CheckpointError(f"{adapter_dir / layout.ADAPTER_CONFIG} names no base model; pass --base DIR")
        base = Path(name)
    if not (base / layout.HF_CONFIG).is_file():
        raise CheckpointError(f"base model folder '{base}' not found (or it has no {layout.HF_CONFIG}); "
                              "pass --base DIR with the base model the adapter was trained on")
    return base


def original_dtypes(base: Path) -> dict[str, torch.dtype]:
    """Each tensor's dtype in the base folder's safetensors files (read from their headers only)."""
    index = base / layout.HF_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        files = sorted({paths.check(f, f"'{index}'") for f in weight_map.values()})
    elif (base / layout.HF_SINGLE_WEIGHTS).is_file():
        files = [layout.HF_SINGLE_WEIGHTS]
    else:
        return {}
    out: dict[str, torch.dtype] = {}
    for name in files:
        header, _ = read_header(base / name)
        for fqn, entry in tensor_entries(header).items():
            if entry["dtype"] in ST_TO_TORCH:
                out[fqn] = ST_TO_TORCH[entry["dtype"]]
    return out


def merged_model(adapter_dir: Path, base: Path) -> Any:
    """Base + adapter merged in float32, then cast tensor by tensor to the base's stored dtypes."""
    from peft import PeftModel

    model = auto_model_class(base).from_pretrained(str(base), dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
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
    """Write the merged model of a PEFT checkpoint to ``out`` (default ``CHECKPOINT/model/merged``)."""
    adapter_dir = adapter_folder(checkpoint)
    base_dir = base_model_folder(adapter_dir, base)
    out = Path(out) if out is not None else adapter_dir / layout.MERGED_DIR
    model = merged_model(adapter_dir, base_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / layout.export_tmp_name(out.name, secrets.token_hex(4))
    try:
        model.save_pretrained(str(tmp))
        _fix_config_dtype(tmp / layout.HF_CONFIG, model.config.dtype)
        for weights in tmp.glob("*.safetensors"):  # written owner-only; as readable as the other files
            shutil.copymode(tmp / layout.HF_CONFIG, weights)
        tokenizer_source = adapter_dir if (adapter_dir / "tokenizer_config.json").is_file() else base_dir
        for name in layout.HF_TOKENIZER_FILES:
            if (tokenizer_source / name).is_file():
                shutil.copyfile(tokenizer_source / name, tmp / name)
        _swap_in(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    manifest.add_files(out)  # no-op outside a checkpoint
    return out


def _fix_config_dtype(config_file: Path, dtype: Any) -> None:
    """``config.json``'s ``dtype`` is the stored one (save_pretrained may record another)."""
    if not isinstance(dtype, torch.dtype):
        return
    data = json.loads(config_file.read_text(encoding="utf-8"))
    name = str(dtype).removeprefix("torch.")
    if data.get("dtype") != name:
        data["dtype"] = name
        config_file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _swap_in(tmp: Path, out: Path) -> None:
    replace_folder(tmp, out, layout.export_old_name(out.name, secrets.token_hex(4)))
