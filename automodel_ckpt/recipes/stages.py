"""A run in stages at run time (docs/stages.md): the recipe each stage is built from, and what a stage's start does.

A run that plans ``stages:`` is a sequence of launches in one process, each built from the recipe of the stage its
next step belongs to and trained until that stage ends (saved there). ``--checkpoint.new_stage NAME`` begins a stage
at a resume the same way, so planned and decided stages give the same steps.
"""

from __future__ import annotations

import copy
import gc
from pathlib import Path
from typing import Any, Callable

from omegaconf import DictConfig, OmegaConf

from automodel_ckpt.checkpoint import run_folder
from automodel_ckpt.config.instantiate import instantiate
from automodel_ckpt.config.stages import FIRST, StagePlan, changed_keys
from automodel_ckpt.errors import CheckpointError, ConfigError
from automodel_ckpt.ondisk import (CONFIG_FILE_LIMIT, SMALL_FILE_LIMIT, CheckpointFolder, RunFolder, is_count,
                                   pointer_target, read_json, read_yaml)
from automodel_ckpt.training.stages import read_history, record


class StageElsewhere(Exception):
    """The checkpoint a launch resumes is of another stage: the run is built again for step ``step`` + 1's."""

    def __init__(self, step: int) -> None:
        super().__init__(f"the checkpoint of step {step} is of another stage")
        self.step = step


class _Held:
    """The lr schedule's place during a staged restore: its state held until a stage's start is known."""

    state: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return self.state or {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state


def run_in_stages(first: Any, plan: StagePlan) -> None:
    """Run recipe ``first``'s class stage by stage, each launch built for the stage its next step belongs to."""
    if not getattr(first, "takes_stages", False):
        raise ConfigError(f"stages: recipe {type(first).__name__} takes no stages (docs/stages.md: the fine-tune "
                          "recipes do)")
    step, at_boundary, seen = _resumed_step(first.checkpoint_config), False, set()
    while True:
        index = plan.index_after(step)
        if (step, index) in seen:
            raise ConfigError(f"stages: the run resumed at step {step} twice for stage "
                              f"'{plan.stages[index].name}'; its checkpoints do not match its plan")
        seen.add((step, index))
        cfg = plan.config(index)
        if at_boundary:  # the run's own newest checkpoint: the one its last stage saved where it ended
            cfg = copy.deepcopy(cfg)
            for key in ("restore_from", "load_only", "new_stage"):
                OmegaConf.update(cfg, f"checkpoint.{key}", None, merge=False)
        recipe = type(first)(cfg)
        recipe._stage_of = (plan, index)
        went_on = recipe.run_launch()
        if went_on is None:
            return
        at_boundary = recipe.step_scheduler.stage_ends
        del recipe
        gc.collect()  # the last stage's model and optimizer go before the next stage's are built
        step = went_on


def _resumed_step(ckpt: Any) -> int:
    """A guess of the step a launch resumes, read before anything is built (0: none); checked after the restore."""
    try:
        folder = run_folder(ckpt)
        target = RunFolder.latest if ckpt.load_only else ckpt.restore_from or RunFolder.latest  # load_only: own first
        if target in (RunFolder.latest, RunFolder.lowest_val, RunFolder.best_eval):
            path = pointer_target(folder, target)
        else:
            path = Path(target) if CheckpointFolder(target).metadata.is_file() else folder / target
        step = read_json(CheckpointFolder(path).metadata, "checkpoint metadata", SMALL_FILE_LIMIT).get("step")
    except (OSError, TypeError, AttributeError, CheckpointError):
        return 0
    return step if is_count(step) else 0


class StageRun:
    """The stages of one launch: each stage's fingerprint, the start of a stage at the restore, each step's stage."""

    def __init__(self, cfg: DictConfig, plan: StagePlan | None = None, index: int = 0) -> None:
        self.cfg, self.plan, self.index = cfg, plan, index
        self.new_stage = cfg.checkpoint.get("new_stage")
        self.active = plan is not None  # also once a restored checkpoint lists stages
        self.history: list[dict[str, Any]] = []
        self.tokens: int | None = 0
        self._fingerprints: dict[int, dict[str, Any]] = {}
        self._event: str | None = None

    # ---------------------------------------------------------------------------------- before the restore
    def built(self, model: Any, fingerprint: dict[str, Any], recipe_of: Callable[[DictConfig], dict]) -> None:
        """Each planned stage's fingerprint (``recipe_of``: its recipe section); its seq_length checked."""
        self._fingerprints[0] = fingerprint
        if self.plan is None:
            return
        positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        for i, stage in enumerate(self.plan.stages):
            cfg = self.plan.config(i)
            self._fingerprints[i] = fingerprint | {"recipe": recipe_of(cfg)}
            if isinstance(positions, int) and cfg.data.seq_length > positions:
                raise ConfigError(f"{'the recipe' if i == 0 else f'stages[{i - 1}] ({stage.name})'}: data.seq_length "
                                  f"({cfg.data.seq_length}) is longer than the model's positions "
                                  f"(max_position_embeddings {positions})")

    def rule(self, meta: dict[str, Any]) -> tuple[dict[str, Any] | None, bool]:
        """For the restore: the fingerprint checkpoint ``meta`` must have, and whether resuming it starts the stage
        ``checkpoint.new_stage`` names. Another stage's checkpoint: ``StageElsewhere``, before any load."""
        step = meta.get("step") if is_count(meta.get("step")) else 0
        if self.plan is not None and self.plan.index_after(step) != self.index:
            raise StageElsewhere(step)
        expected = self._fingerprints.get(self.plan.index_of(step) if self.plan is not None else 0)
        stages = meta.get("stages")
        last = stages[-1] if isinstance(stages, list) and stages and isinstance(stages[-1], dict) else {}
        return expected, self.new_stage is not None and last.get("name", FIRST) != self.new_stage

    def hold(self, recipe: Any) -> None:
        """Before the restore of a run in stages: the schedule's saved state is held (``_Held``) for ``restored``."""
        if self.plan is not None:
            self._built, recipe.lr_scheduler = recipe.lr_scheduler, _Held()

    # ----------------------------------------------------------------------------------- after the restore
    def restored(self, recipe: Any) -> None:
        """After the restore: another stage's checkpoint (the node-local tier the rule does not see) is
        ``StageElsewhere``; else the stages read back, and one that begins at the next step begun."""
        sched = recipe.step_scheduler
        step = sched.step
        if self.plan is not None and self.plan.index_after(step) != self.index:
            raise StageElsewhere(step)
        held = None
        if isinstance(recipe.lr_scheduler, _Held):
            held, recipe.lr_scheduler = recipe.lr_scheduler.state, self._built
        path = recipe.restored.path if "step_scheduler" in recipe.restored.states else None
        self.history, self.tokens = read_history(self._metadata(path), f"'{path}/{CheckpointFolder.metadata}'")
        if not self.history and not self.active:
            return  # a run without stages: nothing of this
        self.active = True
        if not self.history:  # the first stage, from step 1; its tokens were counted from a fresh start only
            fresh = step == 0
            first = self.new_stage if fresh and self.new_stage is not None else FIRST  # a fresh run's own name
            self.history = [record(first, 1, 0, 0, [], float(recipe.optimizer.param_groups[0]["lr"]) if fresh
                                   else None, {"from": 0, "steps": sched.total_steps} if fresh else None)]
            self.tokens = 0 if fresh else None
        starting = self._starting(step, path)
        if starting is not None:
            self._begin(recipe, *starting, held)
        else:
            self._keep_schedule(recipe, held)
        sched.epochs_end = step + recipe.dataloader.steps_left(self.cfg.step_scheduler.num_epochs)
        sched.stop_at = self.plan.ends(self.index) if self.plan is not None else None
        lineage = getattr(recipe, "_lineage", None)
        if isinstance(lineage, dict):  # each checkpoint's lineage names its stage, and the one before it began here
            lineage["stage"] = {"name": self.history[-1]["name"], "first_step": self.history[-1]["first_step"],
                                "after": self.history[-2]["name"] if starting is not None and len(self.history) > 1
                                else None}

    def _metadata(self, path: Path | None) -> dict[str, Any]:
        """The restored checkpoint's metadata (empty: none, or a run without stages that cannot read it)."""
        if path is None:
            return {}
        try:
            meta = read_json(CheckpointFolder(path).metadata, "checkpoint metadata", SMALL_FILE_LIMIT)
            return meta if isinstance(meta, dict) else {}
        except (OSError, CheckpointError):
            if self.active:
                raise
            return {}

    def _starting(self, step: int, path: Path | None) -> tuple[str, list[str]] | None:
        """The stage that begins at step ``step + 1`` and the keys it changes, or None."""
        current, names = self.history[-1]["name"], [s["name"] for s in self.history]
        planned = self.plan.stages[self.index] if self.plan is not None and self.index else None
        starts = []
        if planned is not None and planned.name != current:
            starts.append((planned.name, sorted(planned.values), "stages:"))
        if self.new_stage is not None and self.new_stage != current:
            starts.append((self.new_stage, self._changed_since(path), "checkpoint.new_stage"))
        if len(starts) > 1:
            raise ConfigError(f"checkpoint.new_stage: stage '{planned.name}' of stages: begins at step {step + 1} "
                              "already; leave out --checkpoint.new_stage")
        for name, changed, key in starts:
            if name in names:
                raise ConfigError(f"{key} stage '{name}': the run had a stage of that name already (from step "
                                  f"{self.history[names.index(name)]['first_step']}); give the new stage its own name")
            return name, changed
        return None

    def _changed_since(self, path: Path | None) -> list[str]:
        """The stage keys of this recipe that differ from the checkpoint's recipe copy (``config.yaml``)."""
        if path is None:
            return []
        try:
            before = read_yaml(CheckpointFolder(path).config, "a checkpoint's recipe copy", CONFIG_FILE_LIMIT)
        except (OSError, CheckpointError):
            return []
        return changed_keys(before, OmegaConf.to_container(self.cfg, resolve=True))

    def _begin(self, recipe: Any, name: str, changed: list[str], held: dict[str, Any] | None) -> None:
        """Stage ``name`` begins at the next step: the data from its position, the optimizer's hyper-parameters
        the stage sets, its schedule from the lr in force (a new one where it sets one), its record."""
        sched, optimizer = recipe.step_scheduler, recipe.optimizer
        step, cfg = sched.step, self.cfg
        note = recipe.dataloader.begin_stage()
        sched.epochs_end = step + recipe.dataloader.steps_left(cfg.step_scheduler.num_epochs)
        hyper = {k.split(".", 1)[1] for k in changed if k.startswith("optimizer.") and k.count(".") == 1}
        for group in optimizer.param_groups:
            for key in hyper - {"lr", "_target_"}:
                if key in group:
                    value = OmegaConf.to_container(cfg.optimizer, resolve=True)[key]
                    group[key] = tuple(value) if isinstance(value, list) else value
        schedule = self.history[-1]["schedule"]
        if any(k == "lr_scheduler" or k.startswith("lr_scheduler.") for k in changed) or "lr" in hyper:
            for group in optimizer.param_groups:  # the lr in force, unless the stage sets one
                group["initial_lr"] = group["lr"] = float(cfg.optimizer.lr) if "lr" in hyper else group["lr"]
            schedule = {"from": step, "steps": max(sched.total_steps - step, 1)}
            recipe.lr_scheduler = instantiate(cfg.lr_scheduler, "lr_scheduler", optimizer,
                                              total_steps=schedule["steps"])
        else:
            self._keep_schedule(recipe, held)
        lr = float(optimizer.param_groups[0]["lr"])
        self.history.append(record(name, step + 1, sched.consumed_samples, self.tokens, changed, lr, schedule))
        samples = f"{sched.consumed_samples} samples" + ("" if self.tokens is None else f", {self.tokens} tokens")
        self._event = (f"stage '{name}' begins at step {step + 1} ({samples} before it): "
                       f"{', '.join(changed) or 'nothing changed'}; lr {lr:.4g}" + (f"; {note}" if note else ""))
        if recipe.env.is_main:
            recipe.progress.write(self._event[0].upper() + self._event[1:])

    def _keep_schedule(self, recipe: Any, held: dict[str, Any] | None) -> None:
        """The schedule in force goes on: made again for the steps it began with, its saved state loaded."""
        schedule = self.history[-1]["schedule"]
        steps = None if schedule is None else schedule["steps"]
        if held is None and (recipe.step_scheduler.step == 0 or steps is None):
            return
        optimizer = recipe.optimizer
        lrs, state = [g["lr"] for g in optimizer.param_groups], held or recipe.lr_scheduler.state_dict()
        if steps is not None:
            recipe.lr_scheduler = instantiate(self.cfg.lr_scheduler, "lr_scheduler", optimizer, total_steps=steps)
        try:
            recipe.lr_scheduler.load_state_dict(state)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"the checkpoint's learning-rate schedule is not this recipe's lr_scheduler "
                                  f"({type(exc).__name__}: {str(exc)[:80]}); a rerun that changes the schedule "
                                  "goes on as a new stage (--checkpoint.new_stage NAME, docs/stages.md)") from None
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = lr

    # ------------------------------------------------------------------------------------------ each step
    def step(self, tokens: float, observer: Any) -> dict[str, Any]:
        """After a step over ``tokens`` tokens: its stage, for its record (nothing for a run without stages)."""
        if not self.active:
            return {}
        if self.tokens is not None:
            self.tokens += int(tokens)
        if self._event is not None and observer is not None:
            observer.tracker.event("stage", self._event, self.history[-1]["first_step"])
            self._event = None
        return {"stage": self.history[-1]["name"]}

    def tracked(self) -> dict[str, Any]:
        """What the trackers get of the stage at each step: its number in the run (0: the first)."""
        return {"stage": len(self.history) - 1} if self.active else {}

    def extra(self) -> dict[str, Any]:
        """What each checkpoint's metadata records: the stages so far and the tokens counted."""
        return {"stages": copy.deepcopy(self.history), "consumed_tokens": self.tokens} if self.active else {}
