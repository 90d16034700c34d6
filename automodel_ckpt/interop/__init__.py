"""Other trainers' checkpoints: an HF Trainer or Lightning run read into one shape and put into a recipe, and back.

``read_source(path, limits)`` reads an HF Trainer ``checkpoint-N/`` folder, a Lightning ``.ckpt`` file or a
Lightning distributed checkpoint folder into a ``ForeignRun`` (``source``), its files bounded by ``source.Limits``
(from the recipe's model); ``apply`` loads it into a recipe built as for training; ``hf_export`` writes a recipe's
restored state as an HF Trainer ``checkpoint-N/``. docs/import.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from automodel_ckpt.errors import CheckpointError

__all__ = ["read_source"]


def read_source(src: Path, limits: Any) -> Any:
    """The ``ForeignRun`` of ``src``, whichever trainer wrote it, its files within ``limits`` (``source.Limits``); a
    one-line ``CheckpointError`` otherwise."""
    from automodel_ckpt.interop import hf_trainer, lightning

    if not src.exists():
        raise CheckpointError(f"'{src}' does not exist")
    if hf_trainer.is_hf_trainer(src):
        return hf_trainer.read(src, limits)
    if lightning.is_lightning_file(src):
        return lightning.read_file(src, limits)
    if lightning.is_lightning_folder(src):
        return lightning.read_folder(src, limits)
    raise CheckpointError(f"'{src}' is neither an HF Trainer checkpoint-N/ folder (trainer_state.json), a Lightning "
                          ".ckpt file nor a Lightning distributed checkpoint folder (.metadata)")
