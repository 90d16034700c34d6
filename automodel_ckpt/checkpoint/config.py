"""The `checkpoint:` section of a recipe: schema, defaults and validation of its values."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from automodel_ckpt.checkpoint.retention import check_retention_config
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
    verify_on_load: bool = False  # resume also checks every file's checksum against manifest.json (sizes: always)
    # Retention (docs/retention.md): a checkpoint survives pruning if ANY rule keeps it; nothing is deleted unless
    # max_recent_checkpoints or save_top_k is set.
    max_recent_checkpoints: Optional[int] = None  # keep the K most recent complete checkpoints
    save_top_k: Optional[int] = None  # keep the K best by `monitor` (checkpoints without a finite value never rank)
    keep_steps: List[int] = field(default_factory=list)  # milestone steps whose checkpoints are never deleted
    monitor: str = "val_loss"  # validation metric that ranks checkpoints (save_top_k) and moves LOWEST_VAL
    mode: str = "min"  # min | max: whether a lower or a higher `monitor` is better
    best_metric_key: Optional[str] = None  # with named validation sets: the set whose `monitor` counts
    name_template: str = "epoch_{epoch}_step_{step}"  # folder name; fields: epoch step consumed_samples train_loss val_loss
    # Async saves, preemption and time-based saves (docs/async.md).
    is_async: bool = False  # write model and optimizer shards in the background (torch >= 2.9); training goes on
    preemption_signal: Optional[str] = "SIGTERM"  # on this signal: save at the next step, exit 0 (null: off)
    ckpt_every_minutes: Optional[float] = None  # also save when this many minutes passed since the last save


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
    check_retention_config(cfg)
    cfg.preemption_signal = normalize_signal_name(cfg.preemption_signal)
    if cfg.ckpt_every_minutes is not None and not cfg.ckpt_every_minutes > 0:
        raise ConfigError(f"checkpoint.ckpt_every_minutes: expected a positive number of minutes, "
                          f"got {cfg.ckpt_every_minutes}")


_UNCATCHABLE = ("SIGKILL", "SIGSTOP")


def normalize_signal_name(value: object) -> str | None:
    """``SIGTERM``, ``TERM``, ``sigusr1`` or a number -> the canonical name (``SIGUSR1``); null/false/none -> None."""
    import signal

    if value is None or value is False or str(value).strip().lower() in ("", "null", "none", "false", "off"):
        return None
    text = str(value).strip().upper()
    name = text if text.startswith("SIG") else "SIG" + text
    try:
        sig = signal.Signals(int(text)) if text.isdigit() else signal.Signals[name]
    except (KeyError, ValueError):
        raise ConfigError(f"checkpoint.preemption_signal: '{value}' is not a signal name (e.g. SIGTERM, SIGUSR1; "
                          "null disables)") from None
    if sig.name in _UNCATCHABLE:
        raise ConfigError(f"checkpoint.preemption_signal: {sig.name} cannot be caught; use SIGTERM or SIGUSR1")
    return sig.name
