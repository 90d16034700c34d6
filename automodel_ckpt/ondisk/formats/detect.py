"""Which format a checkpoint's model folder holds, from its file names: the one detector every reader uses."""

from __future__ import annotations

from pathlib import Path

from automodel_ckpt.ondisk.formats import registry


def detect_model_format(folder: Path) -> str | None:
    """The name of the registered format whose files ``folder`` holds (``registry.detect``: a PEFT adapter before
    safetensors shards, whose weights are ``.safetensors`` files too), or None when ``folder`` does not exist or
    holds no model files."""
    fmt = registry.detect(folder)
    return fmt.name if fmt is not None else None
