"""Which checkpoints pruning deletes: a pure policy over checkpoint records, pointer targets and the config's rules.

Nothing here touches the filesystem, so the rules (docs/retention.md) are property-checked on plain values."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

from automodel_ckpt.ondisk import layout
from automodel_ckpt.errors import ConfigError

_MODES = ("min", "max")


@dataclass(frozen=True)
class RetentionPolicy:
    """The retention rules of the `checkpoint:` section (None: that rule is not set)."""

    max_recent: int | None = None
    top_k: int | None = None
    mode: str = "min"
    keep_steps: frozenset[int] = frozenset()
    monitor: str = "val_loss"  # what top_k ranks by, for the reasons' words

    @property
    def prunes(self) -> bool:
        """Whether any rule can delete a checkpoint (without one, everything is kept)."""
        return self.max_recent is not None or self.top_k is not None

    @classmethod
    def from_config(cls, cfg: Any) -> RetentionPolicy:
        return cls(max_recent=cfg.max_recent_checkpoints, top_k=cfg.save_top_k, mode=cfg.mode,
                   keep_steps=frozenset(int(s) for s in (cfg.keep_steps or ())), monitor=str(cfg.monitor))

    def reasons(self, complete: Iterable[tuple[str, int, float | None]],
                protected: Iterable[str] = ()) -> dict[str, list[str]]:
        """Why pruning keeps each complete checkpoint, by name, from its ``(name, step, monitored value)`` (an empty
        list: no rule keeps it); ``protected`` holds the pointer targets."""
        complete = sorted(complete, key=lambda r: r[1])
        sign = 1.0 if self.mode == "min" else -1.0
        ranked = sorted((r for r in complete if _is_finite(r[2])), key=lambda r: (sign * r[2], r[1]))
        recent, best = (complete[-self.max_recent:] if self.max_recent else []), ranked[: self.top_k or 0]
        protected, out = set(protected), {}
        for r in complete:
            why = ["a pointer names it"] if r[0] in protected else []
            why += ["the newest"] if r is complete[-1] else []
            why += [f"one of the {self.max_recent} most recent"] if r in recent else []
            why += [f"one of the {self.top_k} best by {self.monitor}"] if r in best else []
            why += ["its step is in keep_steps"] if r[1] in self.keep_steps else []
            out[r[0]] = why
        return out


@dataclass(frozen=True)
class Candidate:
    """What the policy needs to know about one checkpoint."""

    name: str
    step: int
    metric: float | None = None  # the monitored value; None or non-finite: never ranked
    complete: bool = True  # False while it is still being written (a staging folder)


def _is_finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def is_better(candidate: float | None, current: float | None, mode: str) -> bool:
    """Whether ``candidate`` beats ``current``: finite, and strictly better (or ``current`` has no finite value)."""
    if not _is_finite(candidate):
        return False
    if not _is_finite(current):
        return True
    return candidate < current if mode == "min" else candidate > current  # type: ignore[operator]


def survivors(records: Iterable[Candidate], policy: RetentionPolicy, protected: Iterable[str] = ()) -> set[str]:
    """Names of the complete checkpoints that pruning keeps; ``protected`` holds the pointer targets."""
    why = policy.reasons([(r.name, r.step, r.metric) for r in records if r.complete], protected)
    return {name for name, kept in why.items() if kept or not policy.prunes}


def to_delete(records: Iterable[Candidate], policy: RetentionPolicy, protected: Iterable[str] = ()) -> list[str]:
    """Names of the complete checkpoints pruning deletes, oldest first."""
    records = list(records)
    keep = survivors(records, policy, protected)
    return [r.name for r in sorted(records, key=lambda r: r.step) if r.complete and r.name not in keep]


def check_retention_config(cfg: Any) -> None:
    """ConfigError (one line, naming the key) for retention, best-checkpoint and name-template values."""
    for key in ("max_recent_checkpoints", "save_top_k"):
        value = getattr(cfg, key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ConfigError(f"checkpoint.{key}: expected a non-negative integer or null, got {value!r}")
    for step in cfg.keep_steps or ():
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"checkpoint.keep_steps: expected a list of non-negative steps, got {step!r}")
    if cfg.mode not in _MODES:
        raise ConfigError(f"checkpoint.mode: expected min or max, got '{cfg.mode}'")
    if not str(cfg.monitor or "").strip():
        raise ConfigError("checkpoint.monitor: must name a validation metric, e.g. val_loss")
    if cfg.best_metric_key is not None and not str(cfg.best_metric_key).strip():
        raise ConfigError("checkpoint.best_metric_key: must name a validation set, or be null")
    layout.check_name_template(cfg.name_template)
