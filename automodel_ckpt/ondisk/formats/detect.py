"""Which format a checkpoint's model folder holds, from its file names: the one detector every reader uses."""

from __future__ import annotations

from pathlib import Path

from automodel_ckpt.ondisk import layout


def detect_model_format(folder: Path) -> str | None:
    """``"adapter"`` (a PEFT adapter), ``"safetensors"`` (shards or HF weight files), ``"torch_save"`` (DCP) or None.

    An adapter is recognised first (its weights are a ``.safetensors`` file too); None when ``folder`` does not
    exist or holds no model files.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return None
    if (folder / layout.ADAPTER_WEIGHTS).is_file() or (folder / layout.ADAPTER_CONFIG).is_file():
        return layout.ADAPTER_FORMAT
    if any(p.is_file() for p in folder.glob("*.safetensors")):
        return layout.SAFETENSORS
    if (folder / layout.DCP_METADATA).is_file():
        return layout.TORCH_SAVE
    return None
