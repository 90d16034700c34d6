"""Checkpointing: what to save (discovered state), how (format backends) and when (lifecycle); the public surface.

``Checkpointer`` saves and restores a recipe's discovered state on every rank together; ``CheckpointConfig`` is the
``checkpoint:`` section (validated when made); ``discover_state`` finds what a recipe checkpoints. The names load
on first use, so light modules of this package (``layout``, ``config``) import without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Checkpointer": "checkpointer",
    "HFArtifacts": "info",
    "SaveInfo": "info",
    "WrittenBy": "info",
    "CheckpointConfig": "config",
    "ConsolidationMode": "config",
    "LoadErrorPolicy": "config",
    "ModelSaveFormat": "config",
    "MonitorMode": "config",
    "StatePlan": "state",
    "discover_state": "state",
    "plan_state": "state",
    "written_by": "disk.metadata",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from automodel_ckpt.checkpoint.checkpointer import Checkpointer
    from automodel_ckpt.checkpoint.info import HFArtifacts, SaveInfo, WrittenBy
    from automodel_ckpt.checkpoint.config import (CheckpointConfig, ConsolidationMode, LoadErrorPolicy, ModelSaveFormat,
                                                  MonitorMode)
    from automodel_ckpt.checkpoint.disk.metadata import written_by
    from automodel_ckpt.checkpoint.state import StatePlan, discover_state, plan_state


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
