"""The `checkpoint:` section of a recipe: schema, defaults and validation of its values."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from automodel_ckpt.errors import ConfigError

MODEL_SAVE_FORMATS = ("safetensors", "torch_save")
CONSOLIDATION_MODES = ("final", "every", "false")
_CONSOLIDATION_ALIASES = {"true": "every", "every": "every", "final": "final", "false": "false", "none": "false"}


@dataclass
class CheckpointConfig:
    """Where, in which format, and whether checkpoints are written and restored."""

    enabled: bool = True  # write checkpoints (and auto-resume from them)
    checkpoint_dir: str = "checkpoints/"  # run folder: checkpoints, pointers, training/validation logs
    model_save_format: str = "safetensors"  # safetensors (per-rank HF shards) | torch_save (DCP .distcp)
    save_consolidated: str = "final"  # final | every (alias true) | false: when to export an HF folder
    restore_from: Optional[str] = None  # unset = auto (LATEST); LATEST | LOWEST_VAL | a checkpoint name | a path


def normalize_checkpoint_config(cfg: CheckpointConfig) -> None:
    """Check the values the schema types cannot express; canonicalise aliases in place."""
    if cfg.model_save_format not in MODEL_SAVE_FORMATS:
        raise ConfigError(
            f"checkpoint.model_save_format: expected one of {', '.join(MODEL_SAVE_FORMATS)}, "
            f"got '{cfg.model_save_format}'"
        )
    mode = _CONSOLIDATION_ALIASES.get(str(cfg.save_consolidated).strip().lower())
    if mode is None:
        raise ConfigError(
            "checkpoint.save_consolidated: expected one of final, every, true, false, "
            f"got '{cfg.save_consolidated}'"
        )
    cfg.save_consolidated = mode
    if not str(cfg.checkpoint_dir).strip():
        raise ConfigError("checkpoint.checkpoint_dir: must not be empty")
    if cfg.restore_from is not None and not str(cfg.restore_from).strip():
        cfg.restore_from = None
