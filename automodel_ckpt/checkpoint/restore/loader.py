"""Loads a checkpoint into a recipe's states on every rank: fetch and check, then each state, resharded where needed.

Models by their format, optimizers through DCP (any world size or mesh), global state from rank 0's file, per-rank
state per data-parallel rank (``reshard_state`` when that size changed). A tier of the restore chose it.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from automodel_ckpt.distributed import collective
from automodel_ckpt.checkpoint.config import CheckpointConfig
from automodel_ckpt.ondisk import layout, manifest
from automodel_ckpt.ondisk.loadcheck import LoadCheck, deferred, finish_collectively
from automodel_ckpt.ondisk.metadata import read_metadata, saved_mesh
from automodel_ckpt.ondisk.formats import registry, sharded
from automodel_ckpt.ondisk.formats.safe_load import load_pt
from automodel_ckpt.checkpoint.state import plan_state
from automodel_ckpt.checkpoint.storage.base import RunStorage
from automodel_ckpt.distributed.env import DistEnv, barrier
from automodel_ckpt.distributed.mesh import ParallelDims
from automodel_ckpt.errors import CheckpointError, UserError, first_line, warn


@dataclass(frozen=True)
class Loaded:
    """What a restore loaded: the folder, the states filled, and a continued run's recorded training seconds."""

    path: Path
    states: tuple[str, ...]
    continues_run: bool = False
    training_seconds: float | None = None


class CheckpointLoader:
    """Loads checkpoints of ``run`` into states, on every rank."""

    def __init__(self, cfg: CheckpointConfig, env: DistEnv, dims: ParallelDims, run: RunStorage,
                 say: Callable[[str], None]) -> None:
        self.cfg, self.env, self.dims, self.run, self.say = cfg, env, dims, run, say

    def load(self, states: dict[str, Any], path: Path, *, checked: bool = False, fresh_run: bool = False) -> Loaded:
        """Load ``states`` from ``path``; ``checked``: probed already; ``fresh_run``: a ``load_only`` start."""
        path = Path(path)
        with sharded.reading():  # the reader threads start now, beside the checks and the planning
            if self.env.is_main:
                self.say(f"Loading checkpoint from {self.run.location_of(path)}")
            if not checked:
                self._fetch_and_check(path)
            absent = self._load_states(states, path)
        names = tuple(name for name in states if name not in absent)
        if fresh_run:
            return Loaded(path, names, training_seconds=0.0)
        seconds = float((read_metadata(path) or {}).get("training_seconds") or 0.0)
        return Loaded(path, names, continues_run=True, training_seconds=seconds)

    def _fetch_and_check(self, path: Path) -> None:
        self.run.fetch(path)
        check = functools.partial(manifest.check_before_load, path, checksums=self.cfg.verify_on_load,
                                  rank=self.env.rank, world_size=self.env.world_size, warn=warn, leave=deferred)
        collective.collectively(check, "verifying the checkpoint", self.env.rank)

    def _load_states(self, states: dict[str, Any], path: Path) -> set[str]:
        """Load every state; returns the optional models (``checkpoint_optional``) the checkpoint does not hold."""
        plan = plan_state(states)
        check = None
        if self.cfg.verify_on_load:  # each node's own copy (the node-local tier): each rank checks what it reads
            check = LoadCheck.plan(path, self.env.rank, self.env.world_size) if self.run.shared else \
                LoadCheck.of_reads(path)
        absent = {attr for attr, model in plan.models.items()
                  if getattr(model, "checkpoint_optional", False) and not (path / layout.state_dir(attr)).is_dir()}
        for attr, model in plan.models.items():
            if attr in absent:
                continue
            folder = _require(path / layout.state_dir(attr))
            registry.for_loading(model, folder).load(model, folder, check=check)
        for attr, optim in plan.optimizers.items():
            sharded.load_optimizer(plan.model_for(attr), optim, _require(path / layout.state_dir(attr)), check=check)
        if self.cfg.verify_on_load:  # the deferred files no load above read
            finish_collectively(check, self.env.rank)
        for attr, obj in plan.global_.items():
            self._load_file(attr, obj, path / layout.global_state_file(attr))
        for attr, obj in plan.per_rank.items():
            self._load_per_rank(attr, obj, path)
        barrier()
        return absent

    def _load_per_rank(self, attr: str, obj: Any, path: Path) -> None:
        """Per-rank state is per data-parallel rank; resharded by the object itself when that size changed. A state
        an earlier release saved once for every rank (``attr.pt``, no per-rank files) is loaded on every rank."""
        if not (path / layout.rank_state_file(attr, 0)).exists() and (path / layout.global_state_file(attr)).exists():
            self._load_file(attr, obj, path / layout.global_state_file(attr))
            return
        saved_dp = saved_mesh(path).dp
        dp_rank, dp_size = self.dims.dp_rank, self.dims.dp_size
        if saved_dp != dp_size and hasattr(obj, "reshard_state"):
            _named(path / attr, lambda: obj.load_state_dict(obj.reshard_state(
                lambda rank: load_pt(path / layout.rank_state_file(attr, rank)), saved_dp, dp_rank, dp_size)))
        else:
            self._load_file(attr, obj, path / layout.rank_state_file(attr, dp_rank))

    def _load_file(self, attr: str, obj: Any, file: Path) -> None:
        if not file.exists():
            if self.env.is_main:
                warnings.warn(f"checkpoint has no state for '{attr}' ({file} missing); '{attr}' starts fresh",
                              stacklevel=4)
            return
        state = load_pt(file)
        _named(file, lambda: obj.load_state_dict(state))


def _named(where: Path, load: Callable[[], None]) -> None:
    """``load()``, a state's ``load_state_dict`` of what was read from ``where`` (untrusted): a one-line refusal of
    it names that file (or folder), its type kept (a damaged file still sets its checkpoint aside)."""
    try:
        load()
    except UserError as exc:
        if str(where) not in str(exc):
            exc.args = (f"'{where}': {first_line(exc)}",)
        raise


def _require(folder: Path) -> Path:
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint is missing '{folder}'")
    return folder
