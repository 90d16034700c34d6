"""A rank's small checkpoint files (per-rank and global state, config, losses, metadata): taken at the save, written now or in the background."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from automodel_ckpt.ondisk import layout
from automodel_ckpt.ondisk.info import SaveInfo
from automodel_ckpt.ondisk.metadata import build_metadata, write_metadata
from automodel_ckpt.checkpoint.state import StatePlan


@dataclass
class LocalFiles:
    """The contents of a rank's small files, taken when the save was made; ``write`` puts them in ``staging``.

    Taking them at the save is what makes an async checkpoint the state of its step: the scheduler, the data
    position, the RNG and user state go on changing while the background thread writes.
    """

    staging: Path
    files: dict[Path, bytes] = field(default_factory=dict)
    metadata: dict[str, Any] | None = None  # rank 0: metadata.json, written after the other files
    write_after: Callable[[], None] | None = None  # rank 0: the Hugging Face helper files of the model folder

    def write(self) -> None:
        write_files(self.files)
        if self.metadata is not None:
            write_metadata(self.staging, self.metadata)
        if self.write_after is not None:
            self.write_after()


def capture(staging: Path, plan: StatePlan, info: SaveInfo, *, rank: int, world_size: int, config_yaml: str,
         model_save_format: str, training_seconds: float, fingerprint: dict[str, Any] | None,
         write_after: Callable[[], None] | None = None, dp_rank: int | None = -1,
         mesh: dict[str, int] | None = None) -> LocalFiles:
    """This rank's files, their contents taken now: per-rank state; on rank 0 (``rank == 0``) also global state,
    ``config.yaml``, ``losses.json`` and ``metadata.json`` (and ``write_after``, run after them).

    Per-rank state is per data-parallel rank: ``dp_rank`` names its files (-1: ``rank``, a 1-D mesh), None writes
    none (a tensor-parallel peer of the rank that writes them). ``mesh``: the sizes recorded in the metadata.
    """
    if dp_rank == -1:
        dp_rank = rank
    per_rank = plan.per_rank if dp_rank is not None else {}
    out = LocalFiles(staging, {staging / layout.rank_state_file(a, dp_rank): _pt_bytes(o) for a, o in per_rank.items()})
    if rank != 0:
        return out
    out.files |= {staging / layout.global_state_file(a): _pt_bytes(o) for a, o in plan.global_.items()}
    out.files[staging / layout.CONFIG_FILE] = config_yaml.encode("utf-8")
    losses = {"epoch": info.epoch, "step": info.step, "train_loss": info.train_loss, "val_loss": info.val_loss}
    out.files[staging / layout.LOSSES_FILE] = (json.dumps(losses, indent=2) + "\n").encode("utf-8")
    out.metadata = build_metadata(
        name=staging.name[len(layout.STAGING_PREFIX):], epoch=info.epoch, step=info.step,
        train_loss=info.train_loss, val_loss=info.val_loss, is_final=info.is_final, extra=info.extra,
        world_size=world_size, model_save_format=model_save_format, training_seconds=training_seconds,
        fingerprint=fingerprint, mesh=mesh,
    )
    out.write_after = write_after
    return out


def _pt_bytes(obj: Any) -> bytes:
    """``obj.state_dict()`` as ``torch.save`` writes it, taken now."""
    buffer = io.BytesIO()
    torch.save(obj.state_dict(), buffer)
    return buffer.getvalue()


def write_files(files: dict[Path, bytes]) -> None:
    for path, data in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
