"""The values the checkpointer exchanges with a recipe: what a save records, what an export needs, who wrote it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class HFArtifacts:
    """What an HF export of the model needs besides the weights: configs, tokenizer, the base's own files."""

    hf_config: Any = None
    generation_config: Any = None
    tokenizer: Any = None
    base_model_path: Path | None = None
    peft: dict[str, Any] | None = None  # the recipe's `peft:` section, recorded beside a PEFT adapter


@dataclass
class SaveInfo:
    """What a save records besides the state: counters, losses, whether it is the run's last, extra metadata."""

    epoch: int
    step: int
    train_loss: float | None
    val_loss: float | None
    is_final: bool
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class WrittenBy:
    """The shape of the job that wrote a checkpoint (``automodel_ckpt.checkpoint.written_by``)."""

    world_size: int
    local_batch_size: int | None  # step_scheduler.local_batch_size of its config.yaml, if readable
    mesh: Any = None  # its ``distributed.mesh.MeshSizes`` (dp_replicate × dp_shard × tp)
