"""The `checkpoint:` section of a recipe: schema, defaults, and its validation and normalisation on creation."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional

from automodel_ckpt.ondisk import layout
from automodel_ckpt.ondisk.retention import check_retention_config
from automodel_ckpt.errors import ConfigError, expect
from automodel_ckpt.checkpoint.save_interval import MTBF_LIMIT_HOURS

AUTO = "auto"  # checkpoint.local.every_steps: auto
IDLE = "idle"  # checkpoint.async_nice: idle

class _Choice(str, Enum):
    """A config value from a fixed set: a ``str`` (YAML, OmegaConf and comparisons see the plain value)."""

    def __str__(self) -> str:
        return str(self.value)


class ModelSaveFormat(_Choice):
    """The built-in values of ``checkpoint.model_save_format``; a registered plug-in's name is accepted too."""

    SAFETENSORS = "safetensors"  # per-rank Hugging Face safetensors shards
    TORCH_SAVE = "torch_save"  # DCP .distcp files


class ConsolidationMode(_Choice):
    FINAL = "final"  # export an HF folder with the last checkpoint of a run
    EVERY = "every"  # ... with every checkpoint
    NEVER = "false"  # never inline (``ckpt-train consolidate`` exports later)


class LoadErrorPolicy(_Choice):
    FALLBACK = "fallback"  # auto-resume quarantines a checkpoint that fails to load and tries the previous one
    ERROR = "error"  # stop with the error


class MonitorMode(_Choice):
    MIN = "min"  # a lower `monitor` value is better
    MAX = "max"


_CONSOLIDATION_ALIASES = {"true": ConsolidationMode.EVERY, "every": ConsolidationMode.EVERY,
                          "final": ConsolidationMode.FINAL, "false": ConsolidationMode.NEVER,
                          "none": ConsolidationMode.NEVER}


@dataclass
class LocalTierConfig:
    """The ``checkpoint.local:`` sub-section: node-local steps between durable checkpoints (docs/fast-recovery.md)."""

    every_steps: Any = 0  # take a node-local step every this many optimizer steps (0: off; auto: Young/Daly's interval from the measured cost of a local step, docs/fast-recovery.md)
    min_every_steps: int = 1  # every_steps auto: the shortest interval (also when the first local step comes)
    max_every_steps: Optional[int] = None  # every_steps auto: the longest interval (None: no limit)
    dir: Optional[str] = None  # node-local folder (RAM disk or local NVMe); default `/dev/shm/automodel-ckpt-<user>/<run id>`
    replicas: int = 1  # copies of each rank's part kept on other nodes (0: none)
    keep: int = 1  # node-local steps kept per node

    def __post_init__(self) -> None:
        if isinstance(self.every_steps, str) and self.every_steps.strip().lower() == AUTO:
            self.every_steps = AUTO
        elif isinstance(self.every_steps, str) or isinstance(self.every_steps, (bool, float)):
            raise ConfigError(f"checkpoint.local.every_steps: expected a whole number >= 0 or auto, "
                              f"got {self.every_steps!r}")
        checked = [("replicas", 0), ("keep", 1), ("min_every_steps", 1)]
        for key, least in [("every_steps", 0)] * (self.every_steps != AUTO) + checked:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigError(f"checkpoint.local.{key}: expected a whole number >= {least}, got {value!r}")
        most = self.max_every_steps
        if most is not None and (isinstance(most, bool) or not isinstance(most, int) or most < self.min_every_steps):
            raise ConfigError(f"checkpoint.local.max_every_steps: expected a whole number >= min_every_steps "
                              f"({self.min_every_steps}) or null, got {most!r}")
        if self.dir is not None:
            from automodel_ckpt.checkpoint.locations import is_url

            if not str(self.dir).strip():
                raise ConfigError("checkpoint.local.dir: must not be empty (null: the default under /dev/shm)")
            if is_url(self.dir):
                raise ConfigError(f"checkpoint.local.dir: expected a folder on each node (a RAM disk or local "
                                  f"NVMe), got the URL '{self.dir}'")


@dataclass
class CheckpointConfig:
    """Where, in which format, and whether checkpoints are written and restored."""

    enabled: bool = True  # write checkpoints (and auto-resume from them)
    checkpoint_dir: str = "checkpoints/"  # run folder: checkpoints, pointers, training/validation logs; or s3://BUCKET/PREFIX
    storage_options: Optional[Dict[str, Any]] = field(default=None, repr=False)  # object store checkpoint_dir: fsspec options (endpoint_url, key, ...)
    staging_dir: Optional[str] = None  # object store checkpoint_dir: local folder for writes and loads (default: ~/.cache)
    model_save_format: str = ModelSaveFormat.SAFETENSORS.value  # safetensors (per-rank HF shards) | torch_save (DCP .distcp)
    save_consolidated: str = "final"  # final | every (alias true) | false: when to export an HF folder
    incremental: bool = False  # tensors that do not train (frozen, a synced DPO reference) stored once: unchanged files hard-linked from the last checkpoint
    restore_from: Optional[str] = None  # unset = auto (LATEST); LATEST | LOWEST_VAL | a checkpoint name | a path
    verify_on_load: bool = False  # resume also checks every file's checksum against manifest.json (sizes: always)
    on_load_error: str = "fallback"  # fallback | error: what auto-resume does when the newest checkpoint is damaged
    load_only: Optional[List[str]] = None  # with restore_from: load only these states (e.g. [model]), a new run
    new_stage: Optional[str] = None  # a rerun whose recipe changes the data, sequence length, batch or schedule goes on as a new stage of this name after the step it resumes (docs/stages.md)
    # Retention (docs/retention.md): kept if ANY rule keeps it; none deleted without max_recent_checkpoints/save_top_k
    max_recent_checkpoints: Optional[int] = None  # keep the K most recent complete checkpoints
    save_top_k: Optional[int] = None  # keep the K best by `monitor` (checkpoints without a finite value never rank)
    keep_steps: List[int] = field(default_factory=list)  # milestone steps whose checkpoints are never deleted
    monitor: str = "val_loss"  # validation metric that ranks checkpoints (save_top_k) and moves LOWEST_VAL
    mode: str = "min"  # min | max: whether a lower or a higher `monitor` is better
    best_metric_key: Optional[str] = None  # with named validation sets: the set whose `monitor` counts
    name_template: str = "epoch_{epoch}_step_{step}"  # folder name; fields: epoch step consumed_samples train_loss val_loss
    # Async saves, preemption and time-based saves (docs/async.md).
    is_async: bool = False  # copy and write the state in the background (torch >= 2.9); the next optimizer step waits only for the copy
    preemption_signal: Optional[str] = "SIGTERM"  # on this signal: save at the next step, exit 0 (null: off)
    ckpt_every_minutes: Optional[float] = None  # also save when this many minutes passed since the last save
    mtbf_hours: Optional[float] = None  # mean time between failures for step_scheduler.ckpt_every_steps: auto (null: observed in the run's events.jsonl, else 24)
    async_write_threads: Optional[int] = None  # background writer threads per rank (null: cores per local rank - 1, 1..4)
    async_nice: Any = IDLE  # the background threads' priority: idle (Linux's SCHED_IDLE: only cores nothing else wants) or a niceness added, 0-19 (0 on big nodes)
    local: LocalTierConfig = field(default_factory=LocalTierConfig)  # node-local steps (docs/fast-recovery.md)

    def __post_init__(self) -> None:
        """Validate once and canonicalise (enums, aliases, empty restore_from unset), however it is made."""
        from automodel_ckpt.checkpoint.locations import check_location

        self.model_save_format = _model_save_format(self.model_save_format)
        mode = _CONSOLIDATION_ALIASES.get(str(self.save_consolidated).strip().lower())
        if mode is None:
            raise ConfigError("checkpoint.save_consolidated: expected one of final, every, true, false, "
                              f"got '{self.save_consolidated}'")
        self.save_consolidated = mode
        if not str(self.checkpoint_dir).strip():
            raise ConfigError("checkpoint.checkpoint_dir: must not be empty")
        check_location(self.checkpoint_dir, "checkpoint.checkpoint_dir")  # a URL never becomes a local path
        if self.restore_from is not None:
            check_location(self.restore_from, "checkpoint.restore_from")
        if self.restore_from is not None and not str(self.restore_from).strip():
            self.restore_from = None  # `--checkpoint.restore_from ""` means "not set": resume from the latest
        self.mode = _choice(MonitorMode, self.mode, "checkpoint.mode")
        self.on_load_error = _choice(LoadErrorPolicy, self.on_load_error, "checkpoint.on_load_error")
        if self.load_only is not None:
            self.load_only = [str(name).strip() for name in self.load_only if str(name).strip()]
            if not self.load_only:
                raise ConfigError("checkpoint.load_only: expected state names such as [model], got an empty list")
            if self.restore_from is None or self.restore_from in layout.POINTERS:
                raise ConfigError("checkpoint.load_only needs checkpoint.restore_from: the path of a checkpoint, a "
                                  "consolidated Hugging Face folder or a PEFT adapter folder to start from")
        check_retention_config(self)
        self.preemption_signal = normalize_signal_name(self.preemption_signal)
        expect(self.async_write_threads is None or self.async_write_threads >= 1, "checkpoint.async_write_threads",
               "a positive number of threads (or null)", self.async_write_threads)
        expect(self.async_nice == IDLE or type(self.async_nice) is int and 0 <= self.async_nice <= 19,
               "checkpoint.async_nice", "idle or a niceness between 0 and 19", self.async_nice)
        if self.mtbf_hours is not None and (isinstance(self.mtbf_hours, bool) or
                                            not isinstance(self.mtbf_hours, (int, float)) or
                                            not 0 < self.mtbf_hours <= MTBF_LIMIT_HOURS):
            raise ConfigError(f"checkpoint.mtbf_hours: expected a positive number of hours, at most "
                              f"{MTBF_LIMIT_HOURS:g}, got {str(self.mtbf_hours)[:40]}")
        expect(self.ckpt_every_minutes is None or self.ckpt_every_minutes > 0, "checkpoint.ckpt_every_minutes",
               "a positive number of minutes", self.ckpt_every_minutes)

    @classmethod
    def from_section(cls, section: Any) -> CheckpointConfig:
        """The validated config of a recipe's ``checkpoint:`` section (an OmegaConf node of this schema)."""
        from omegaconf import OmegaConf

        return section if isinstance(section, cls) else OmegaConf.to_object(section)


def _choice(kind: type[_Choice], value: object, key: str) -> Any:
    try:
        return kind(str(value).strip().lower())
    except ValueError:
        raise ConfigError(f"{key}: expected one of {', '.join(m.value for m in kind)}, got '{value}'") from None


def _model_save_format(value: object) -> Any:
    """A registered model format's name: a built-in one as its ``ModelSaveFormat``, a plug-in's as the string."""
    from automodel_ckpt.ondisk.formats import registry

    name = str(value).strip().lower()
    if name not in registry.names():
        raise ConfigError(f"checkpoint.model_save_format: expected one of {', '.join(registry.names())}, "
                          f"got '{value}'")
    return ModelSaveFormat(name) if name in ModelSaveFormat._value2member_map_ else name


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
