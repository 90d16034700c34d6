"""Other trainers' checkpoints (HF Trainer, Lightning, DeepSpeed, torchtitan) read into one shape, put into a recipe.

``registry`` finds the source (``contract.ImportSource``: one module and one ``register_source`` line each), which
reads the run into a ``source.ForeignRun`` within ``source.Limits``; ``apply`` loads it into a recipe;
``hf_export`` writes a recipe's state as an HF Trainer ``checkpoint-N/``. docs/import.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["read_source"]


def read_source(src: Path, limits: Any) -> Any:
    """``registry.read_source``, imported on first use."""
    from automodel_ckpt.interop.registry import read_source as read

    return read(src, limits)
