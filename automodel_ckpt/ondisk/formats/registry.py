"""The model formats, by name: each is one module of this package, registered here by one line.

``detect(folder)`` asks in registration order (an adapter first: its weights are a ``.safetensors`` file too)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from automodel_ckpt.errors import CheckpointError, ConfigError
from automodel_ckpt.ondisk.formats import adapter, dcp_shards, safetensors_shards
from automodel_ckpt.ondisk.formats.base import ModelFormat
from automodel_ckpt.registry import Registry

_FORMATS: Registry[ModelFormat] = Registry("a model format", lambda name, names: ConfigError(
    f"checkpoint.model_save_format: expected one of {', '.join(names)}, got '{name}'"))
register, unregister, get = _FORMATS.register, _FORMATS.unregister, _FORMATS.get

register(adapter.FORMAT)
register(safetensors_shards.FORMAT)
register(dcp_shards.FORMAT)

#: the format a model folder whose files no format recognises is read as: its reader names the missing file
FALLBACK = dcp_shards.NAME


def names(configurable: bool = True) -> list[str]:
    """The registered formats' names, in order; with ``configurable`` only ``model_save_format``'s values."""
    return [fmt.name for fmt in _FORMATS if fmt.configurable or not configurable]


def formats() -> list[ModelFormat]:
    return list(_FORMATS)


def detect(folder: Path) -> ModelFormat | None:
    """The format whose files ``folder`` holds; None when it does not exist or holds no model files."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    return _FORMATS.first(lambda fmt: fmt.detect(folder))


def detect_model_format(folder: Path) -> str | None:
    """The name of the format ``detect`` finds in ``folder``, or None: the one detector every reader uses."""
    fmt = detect(folder)
    return fmt.name if fmt is not None else None


def exported_format(folder: Path) -> ModelFormat:
    """The format of ``folder``'s model files the export reads; ``CheckpointError`` for none or one not exported."""
    fmt = detect(folder)
    if fmt is not None and fmt.export_refusal:
        raise CheckpointError(f"{folder} {fmt.export_refusal}")
    if fmt is None:
        if not Path(folder).exists():
            raise CheckpointError(f"model folder {folder} does not exist")
        expected = " or ".join(f.files for f in _FORMATS if not f.export_refusal)
        raise CheckpointError(f"no model shards in {folder}: expected {expected}")
    return fmt


def for_model(model: Any, configured: Any) -> ModelFormat:
    """The format a save writes ``model`` in: one that claims it (a PEFT model's adapter), else ``configured``."""
    return _FORMATS.first(lambda fmt: fmt.claims(model)) or get(configured)


def for_loading(model: Any, folder: Path) -> ModelFormat:
    """The format to load ``folder`` into ``model``: one claiming the model, else the detected, else ``FALLBACK``."""
    claimed = _FORMATS.first(lambda fmt: fmt.claims(model))
    if claimed is not None:
        return claimed
    found = detect(folder)
    return found if found is not None and found.accepts(model) else get(FALLBACK)
