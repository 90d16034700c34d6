"""Other trainers' checkpoints: an HF Trainer or Lightning run read into one shape and put into a recipe, and back.

``read_source(path, limits)`` reads an HF Trainer ``checkpoint-N/`` folder, a Lightning ``.ckpt`` file or a
Lightning distributed checkpoint folder into a ``ForeignRun`` (``source``), its files bounded by ``source.Limits``
(from the recipe's model): the sources are ``registry``'s, each one module and one ``register_source`` line
(``contract.ImportSource``); ``apply`` loads the run into a recipe built as for training; ``hf_export`` writes a
recipe's restored state as an HF Trainer ``checkpoint-N/``. docs/import.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["read_source"]


def read_source(src: Path, limits: Any) -> Any:
    """The ``ForeignRun`` of ``src``, whichever registered source it is, its files within ``limits``
    (``source.Limits``); a one-line ``CheckpointError`` otherwise (``registry.read_source``)."""
    from automodel_ckpt.interop.registry import read_source as read

    return read(src, limits)
