"""PEFT adapters as the model state of a checkpoint: one Hugging Face PEFT folder, written by rank 0.

``model/`` is a folder PEFT loads as it is (docs/peft.md); a load is bit-identical whatever the world size."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from automodel_ckpt.distributed import collective
from automodel_ckpt.ondisk import layout
from automodel_ckpt.ondisk.durable import write_json
from automodel_ckpt.distributed.env import all_gather_object, gather_object
from automodel_ckpt.errors import CheckpointError, first_line

_FORMAT_VERSION = 1
_ADAPTER_NAME = "default"  # PEFT's name of the single adapter a recipe trains
_GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
_GATHER_ON_EVERY_RANK = StateDictOptions(full_state_dict=True, ignore_frozen_params=True)


def is_peft_model(model: Any) -> bool:
    """Whether ``model`` is a PEFT model (also after FSDP wrapping, which subclasses it in place)."""
    if "peft" not in sys.modules:  # no PEFT model can exist before peft is imported; keep full runs free of it
        return False
    from peft import PeftModel

    return isinstance(model, PeftModel)


def trainable_names(model: nn.Module) -> list[str]:
    """Names of the trainable parameters, as the model's state dict spells them."""
    return [name for name, p in model.named_parameters() if p.requires_grad]


def peft_key_map(model: nn.Module, names: list[str]) -> dict[str, str]:
    """``{model state-dict name: adapter file key}``, by running PEFT's ``get_peft_model_state_dict`` on
    placeholders (``...lora_A.default.weight`` -> ``...lora_A.weight``). A trainable parameter PEFT would not save
    is an error: a resume would silently lose it."""
    from peft.utils import get_peft_model_state_dict

    placeholders = {name: torch.tensor(i) for i, name in enumerate(names)}
    mapped = get_peft_model_state_dict(model, state_dict=placeholders, adapter_name=_ADAPTER_NAME,
                                       save_embedding_layers=False)
    out = {names[int(index)]: key for key, index in mapped.items()}
    unsaved = [n for n in names if n not in out]
    if unsaved:
        raise CheckpointError(f"{len(unsaved)} trainable parameter(s) are not part of the PEFT adapter (e.g. "
                              f"'{unsaved[0]}'); a PEFT checkpoint holds adapter weights only")
    return out


def adapter_config_dict(model: nn.Module, base_model_path: Path | None) -> dict[str, Any]:
    """``adapter_config.json`` content: the LoRA config as PEFT writes it, naming the local base folder."""
    data = {k: sorted(v) if isinstance(v, set) else v for k, v in model.peft_config[_ADAPTER_NAME].to_dict().items()}
    data["inference_mode"] = True
    data["base_model_name_or_path"] = str(Path(base_model_path).resolve()) if base_model_path is not None else None
    return data


def save_adapter(model: nn.Module, folder: Path, *, rank: int, base_model_path: Path | None = None,
                 tokenizer: Any = None, peft_section: dict[str, Any] | None = None) -> None:
    """Collective: gather the full adapter tensors to rank 0, which writes ``folder``; its failure raises on all."""
    names = trainable_names(model)
    maps = collective.gathered(lambda: peft_key_map(model, names), f"naming the adapter of '{folder}'", rank)
    keys = maps[rank]
    held = [sorted(m.values()) for m in maps]  # each rank's adapter keys
    elsewhere = set().union(*held) - set(held[0])  # other pipeline stages' adapters
    if not elsewhere:
        full = get_model_state_dict(model, options=_GATHER)  # collective; only rank 0 keeps the tensors
        received: dict[str, torch.Tensor] = {}
    else:  # each stage's full tensors on its ranks; the first rank holding each tensor rank 0 lacks sends it to 0
        full = get_model_state_dict(model, options=_GATHER_ON_EVERY_RANK)
        first = {key: r for r in reversed(range(len(held))) for key in held[r]}
        sent = {keys[n]: full[n].detach().cpu() for n in names if keys[n] in elsewhere and first[keys[n]] == rank}
        received = {key: t for part in gather_object(sent) or [] for key, t in part.items()}

    def write() -> None:
        missing = sorted(set(names) - set(full))
        if missing:
            raise CheckpointError(f"gathered adapter state lacks '{missing[0]}'")
        tensors = {keys[name]: full[name].detach().cpu().contiguous() for name in names}
        tensors.update({key: t.contiguous() for key, t in received.items()})
        adapter_config = adapter_config_dict(model, base_model_path)
        automodel_config = {
            "format_version": _FORMAT_VERSION,
            "peft": dict(peft_section or {}),
            "adapted_modules": sorted({k.split(".lora_")[0] for k in tensors if ".lora_" in k}),
            "trainable_parameters": int(sum(t.numel() for t in tensors.values())),
            "base_model_name_or_path": adapter_config["base_model_name_or_path"],
        }
        write_adapter_folder(folder, tensors, adapter_config, automodel_config=automodel_config,
                             tokenizer=tokenizer, base_model_path=base_model_path)

    collective.on_main(write, f"writing the adapter to '{folder}'", rank)


def write_adapter_folder(folder: Path, tensors: dict[str, torch.Tensor], adapter_config: dict[str, Any], *,
                         automodel_config: dict[str, Any], tokenizer: Any = None,
                         base_model_path: Path | None = None) -> None:
    """Write the adapter folder's files (one process). Tokenizer: ``tokenizer`` if given, else the base's files."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / layout.ADAPTER_WEIGHTS), metadata={"format": "pt"})
    write_json(folder / layout.ADAPTER_CONFIG, adapter_config)
    shutil.copymode(folder / layout.ADAPTER_CONFIG, folder / layout.ADAPTER_WEIGHTS)  # safetensors writes 0600
    write_json(folder / layout.PEFT_FULL_CONFIG, automodel_config)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))
    elif base_model_path is not None:
        for name in layout.HF_TOKENIZER_FILES:
            if (Path(base_model_path) / name).is_file():
                shutil.copyfile(Path(base_model_path) / name, folder / name)


def _read_adapter_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """The adapter tensors of a PEFT folder, by their file keys (a one-line ``CheckpointError`` if unreadable)."""
    from safetensors.torch import load_file

    file = Path(folder) / layout.ADAPTER_WEIGHTS
    if not file.is_file():
        raise CheckpointError(f"checkpoint is missing '{file}' (not a PEFT checkpoint?)")
    try:
        return load_file(str(file))
    except Exception as exc:  # noqa: BLE001 - a damaged file must be one line, not a traceback
        raise CheckpointError(f"cannot read '{file}': {first_line(exc)}") from None


def load_adapter(model: nn.Module, folder: Path) -> None:
    """Collective: restore ``model``'s adapter weights from a PEFT folder, each rank keeping its own shards; the
    LoRA tensors must be exactly those the ranks hold together, of the same shapes."""
    names = trainable_names(model)
    keys = peft_key_map(model, names)
    expected = set().union(*all_gather_object(sorted(keys.values())))  # every stage's
    saved = _read_adapter_tensors(folder)
    missing, unexpected = sorted(expected - set(saved)), sorted(set(saved) - expected)
    if missing or unexpected:
        parts = [f"{len(missing)} missing (e.g. '{missing[0]}')"] if missing else []
        parts += [f"{len(unexpected)} unexpected (e.g. '{unexpected[0]}')"] if unexpected else []
        raise CheckpointError(f"the adapter in '{folder}' does not fit the model: {', '.join(parts)} tensor(s); "
                              "was it saved with other peft.target_modules?")
    params = dict(model.named_parameters())
    state = {}
    for name in names:
        tensor, want = saved[keys[name]], tuple(params[name].shape)
        if tuple(tensor.shape) != want:
            raise CheckpointError(f"the adapter in '{folder}' does not fit the model: '{keys[name]}' has shape "
                                  f"{tuple(tensor.shape)}, the model expects {want}; "
                                  "was it saved with another peft.rank?")
        state[name] = tensor
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))
