"""Saves and restores a recipe's discovered state as one checkpoint folder, on every rank together."""

from __future__ import annotations

import json
import logging
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from automodel_ckpt.checkpoint import layout, lifecycle
from automodel_ckpt.checkpoint.config import CheckpointConfig
from automodel_ckpt.checkpoint.formats import sharded
from automodel_ckpt.checkpoint.state import StatePlan, plan_state
from automodel_ckpt.checkpoint.storage import fsync_tree
from automodel_ckpt.distributed.env import DistEnv, barrier
from automodel_ckpt.errors import CheckpointError

logger = logging.getLogger(__name__)


@dataclass
class HFArtifacts:
    """What an HF export of the model needs besides the weights: configs, tokenizer, the base's own files."""

    hf_config: Any = None
    generation_config: Any = None
    tokenizer: Any = None
    base_model_path: Path | None = None


@dataclass
class SaveInfo:
    epoch: int
    step: int
    train_loss: float | None
    val_loss: float | None
    is_final: bool
    extra: dict[str, Any] = field(default_factory=dict)


class Checkpointer:
    """Writes ``epoch_E_step_N/`` (see ``layout``) from discovered state and restores state from it."""

    def __init__(
        self,
        cfg: CheckpointConfig,
        env: DistEnv,
        *,
        resolved_config_yaml: str,
        hf: HFArtifacts | None = None,
        say: Callable[[str], None] = print,
    ) -> None:
        self.cfg = cfg
        self.env = env
        self.dir = Path(cfg.checkpoint_dir)
        self.resolved_config_yaml = resolved_config_yaml
        self.hf = hf or HFArtifacts()
        self.say = say
        self._warned_torch_save_consolidation = False

    # ------------------------------------------------------------------------------------------ save
    def save(self, states: dict[str, Any], info: SaveInfo) -> Path:
        name = layout.checkpoint_name(info.epoch, info.step)
        final = self.dir / name
        rank = self.env.rank
        if self.env.is_main:
            self.say(f"Saving checkpoint to {final}")
        staging = lifecycle.on_main(lambda: lifecycle.reserve(self.dir, name), "reserving the checkpoint", rank)
        plan = plan_state(states)
        fmt = self.cfg.model_save_format
        for attr, model in plan.models.items():  # collective; DCP raises on every rank if any rank fails
            sharded.save_model(model, staging / layout.state_dir(attr), fmt)
        for attr, optim in plan.optimizers.items():
            sharded.save_optimizer(plan.model_for(attr), optim, staging / layout.state_dir(attr))
        lifecycle.collectively(lambda: self._write_local(staging, plan, info), "writing the checkpoint", rank)
        if self._consolidate_now(info, plan):
            lifecycle.collectively(lambda: self._consolidate(staging, plan), "consolidating the checkpoint", rank)
        lifecycle.collectively(lambda: fsync_tree(staging, rank, self.env.world_size), "syncing the checkpoint", rank)
        best = self._is_new_best(info.val_loss)
        path = lifecycle.on_main(
            lambda: lifecycle.publish(self.dir, name, update_lowest_val=best), "publishing the checkpoint", rank
        )
        barrier()
        return path

    def _write_local(self, staging: Path, plan: StatePlan, info: SaveInfo) -> None:
        """This rank's files: per-rank state; on rank 0 also global state, config, losses and HF helpers."""
        for attr, obj in plan.per_rank.items():
            target = staging / layout.rank_state_file(attr, self.env.rank)
            target.parent.mkdir(parents=True, exist_ok=True)
            torch.save(obj.state_dict(), target)
        if not self.env.is_main:
            return
        for attr, obj in plan.global_.items():
            torch.save(obj.state_dict(), staging / layout.global_state_file(attr))
        (staging / layout.CONFIG_FILE).write_text(self.resolved_config_yaml, encoding="utf-8")
        losses = {"epoch": info.epoch, "step": info.step, "train_loss": info.train_loss, "val_loss": info.val_loss}
        (staging / layout.LOSSES_FILE).write_text(json.dumps(losses, indent=2) + "\n", encoding="utf-8")
        if plan.models and self.cfg.model_save_format == sharded.SAFETENSORS:
            self._write_hf_helpers(staging / layout.MODEL_DIR)

    def _write_hf_helpers(self, model_dir: Path) -> None:
        from automodel_ckpt.checkpoint.consolidate import render_consolidate_script
        from automodel_ckpt.checkpoint.hf_metadata import write_hf_metadata

        write_hf_metadata(
            model_dir,
            hf_config=self.hf.hf_config,
            generation_config=self.hf.generation_config,
            tokenizer=self.hf.tokenizer,
            base_model_path=self.hf.base_model_path,
        )
        render_consolidate_script(model_dir)

    def _consolidate_now(self, info: SaveInfo, plan: StatePlan) -> bool:
        mode = self.cfg.save_consolidated
        wanted = mode == "every" or (mode == "final" and info.is_final)
        if not wanted or not plan.models:
            return False
        if self.cfg.model_save_format != sharded.SAFETENSORS:
            if self.env.is_main and not self._warned_torch_save_consolidation:
                warnings.warn(
                    f"checkpoint.save_consolidated={mode} needs model_save_format=safetensors; skipping the inline "
                    "HF export (run `ckpt-train consolidate CHECKPOINT` later to export this checkpoint)",
                    stacklevel=2,
                )
                self._warned_torch_save_consolidation = True
            return False
        return True

    def _consolidate(self, staging: Path, plan: StatePlan) -> None:
        from automodel_ckpt.checkpoint.consolidate import consolidate

        consolidate(
            staging / layout.MODEL_DIR,
            rank=self.env.rank,
            world_size=self.env.world_size,
            progress=False,
        )

    def _is_new_best(self, val_loss: float | None) -> bool:
        if val_loss is None or not math.isfinite(val_loss):
            return False
        current = lifecycle.pointer_target(self.dir, layout.LOWEST_VAL)
        if current is None:
            return True
        best = read_losses(current).get("val_loss")
        return best is None or not math.isfinite(float(best)) or val_loss < float(best)

    # ------------------------------------------------------------------------------------------ load
    def find_restore_target(self) -> Path | None:
        """The checkpoint to restore (as decided by rank 0), or None to start fresh."""
        if not self.cfg.enabled and self.cfg.restore_from is None:
            return None
        return lifecycle.on_main(
            lambda: lifecycle.resolve_restore_from(self.dir, self.cfg.restore_from), "finding the checkpoint", self.env.rank
        )

    def load(self, states: dict[str, Any], path: Path) -> None:
        path = Path(path)
        if self.env.is_main:
            self.say(f"Loading checkpoint from {path}")
        plan = plan_state(states)
        for attr, model in plan.models.items():
            folder = self._require(path / layout.state_dir(attr))
            sharded.load_model(model, folder, sharded.detect_model_format(folder))
        for attr, optim in plan.optimizers.items():
            folder = self._require(path / layout.state_dir(attr))
            sharded.load_optimizer(plan.model_for(attr), optim, folder)
        for attr, obj in plan.global_.items():
            file = path / layout.global_state_file(attr)
            if not file.exists():
                self._missing_state(attr, file)
                continue
            obj.load_state_dict(_load_pt(file))
        for attr, obj in plan.per_rank.items():
            file = path / layout.rank_state_file(attr, self.env.rank)
            if not file.exists():
                self._missing_state(attr, file)
                continue
            obj.load_state_dict(_load_pt(file))
        barrier()

    def _require(self, folder: Path) -> Path:
        if not folder.is_dir():
            raise CheckpointError(f"checkpoint is missing '{folder}'")
        return folder

    def _missing_state(self, attr: str, file: Path) -> None:
        if self.env.is_main:
            warnings.warn(f"checkpoint has no state for '{attr}' ({file} missing); '{attr}' starts fresh", stacklevel=3)


def _load_pt(file: Path) -> Any:
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"cannot read '{file}': {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None


def read_losses(checkpoint: Path) -> dict[str, Any]:
    file = Path(checkpoint) / layout.LOSSES_FILE
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
