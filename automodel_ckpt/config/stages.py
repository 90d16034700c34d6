"""A run's stages (``stages:``, docs/stages.md): the plan read from the recipe and checked, and each stage's recipe.

The recipe as written is stage ``main``; each entry of ``stages:`` begins after step ``at_step`` with ``set`` merged
into the stage before it, as overrides are. A stage changes how the run goes on, never what its checkpoints are of.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from omegaconf import DictConfig, OmegaConf

from automodel_ckpt.config.loader import apply_values
from automodel_ckpt.config.sections import present
from automodel_ckpt.errors import ConfigError, expect
from automodel_ckpt.redact import redacted

FIRST = "main"  # the first stage's name: the recipe as written
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_ENTRY = ("name", "at_step", "set")
#: The sections a stage may change.
_SECTIONS = ("step_scheduler", "data", "dataset", "validation_dataset", "lr_scheduler", "optimizer", "training",
             "evaluation")
#: Keys of those sections that stay the run's, and why.
_LENGTH = ("step_scheduler.max_steps", "step_scheduler.num_epochs")
_KEPT = {
    "step_scheduler.max_steps": "the run's length is the run's",
    "step_scheduler.num_epochs": "the run's length is the run's",
    "data.shuffle": "the order of an epoch is the run's",
    "data.val_size": "the held-out split is the run's",
    "data.lanes": "a streamed corpus's order is made over the run's lanes",
    "data.shuffle_buffer": "a streamed corpus's order is drawn through the run's shuffle buffer",
    "optimizer._target_": "a stage keeps the optimizer and its state",
}


@dataclass(frozen=True)
class Stage:
    """One stage: its name, the step after which it begins (0: the first) and what it sets."""

    name: str
    at_step: int
    values: dict[str, Any]


def where(index: int, name: Any) -> str:
    """How a message names entry ``index`` of ``stages:``."""
    return f"stages[{index}] ({str(name)[:64]})"


class StagePlan:
    """The stages planned in a recipe, ``main`` first; each one's recipe made on first use (``config``)."""

    def __init__(self, base: DictConfig, planned: list[Stage]) -> None:
        self.base = base
        self.stages = [Stage(FIRST, 0, {}), *planned]
        self._configs: dict[int, DictConfig] = {0: base}

    @classmethod
    def of(cls, cfg: DictConfig) -> StagePlan | None:
        """The plan of recipe ``cfg``, checked; None for a run without stages."""
        entries = OmegaConf.to_container(cfg.stages, resolve=True) if cfg.get("stages") else []
        new_stage = cfg.checkpoint.get("new_stage")
        if not entries and new_stage is None:
            return None
        _check_run(cfg, new_stage)
        planned, names = [], {FIRST}
        max_steps = cfg.step_scheduler.max_steps
        for i, entry in enumerate(entries):
            stage = _entry(i, entry, planned[-1].at_step if planned else 0, max_steps)
            if stage.name in names:
                raise ConfigError(f"{where(i, stage.name)}.name: another stage is named '{stage.name}' (the recipe "
                                  f"as written is '{FIRST}'); give each stage a name of its own")
            names.add(stage.name)
            planned.append(stage)
        plan = cls(cfg, planned)
        for i, stage in enumerate(planned, start=1):
            plan.config(i)  # each stage's recipe made now: an unknown key is said (with a suggestion) before training
            for key in stage.values:
                _check_key(f"{where(i - 1, stage.name)}.set", key)
        return plan

    def index_after(self, step: int) -> int:
        """The stage that step ``step + 1`` belongs to (the one a run resumed at ``step`` goes on in)."""
        return max(i for i, stage in enumerate(self.stages) if stage.at_step <= step)

    def index_of(self, step: int) -> int:
        """The stage that trained step ``step`` (0 for step 0: nothing trained yet)."""
        return self.index_after(max(step - 1, 0))

    def ends(self, index: int) -> int | None:
        """The step after which stage ``index`` ends (None: it is the last)."""
        return self.stages[index + 1].at_step if index + 1 < len(self.stages) else None

    def config(self, index: int) -> DictConfig:
        """Stage ``index``'s recipe: the recipe as written with each ``set`` up to it applied in order."""
        if index not in self._configs:
            stage = self.stages[index]
            origin = f"{where(index - 1, stage.name)}.set"
            self._configs[index] = apply_values(self.config(index - 1), stage.values, origin)
        return self._configs[index]

    def check(self, check: Callable[[DictConfig], Any]) -> None:
        """``check`` of each planned stage's recipe, its message prefixed by the stage."""
        for i, stage in enumerate(self.stages[1:], start=1):
            try:
                check(self.config(i))
            except ConfigError as exc:
                raise ConfigError(f"{where(i - 1, stage.name)}: {exc}") from None


def _check_run(cfg: DictConfig, new_stage: Any) -> None:
    """What a run in stages needs: checkpoints (a stage begins at one), an algorithm whose state a stage keeps."""
    if not cfg.checkpoint.get("enabled", True):
        raise ConfigError("stages: a stage begins at a checkpoint of the run; set checkpoint.enabled true")
    refusal = next((s.no_stages for s in present(cfg) if s.no_stages), None)
    if refusal:
        raise ConfigError(f"stages: {refusal}")
    if new_stage is not None:
        expect(isinstance(new_stage, str) and bool(_NAME.match(new_stage)), "checkpoint.new_stage",
               "a stage name (letters, digits, _ . -; at most 64)", str(new_stage)[:80])
        if cfg.checkpoint.get("load_only"):
            raise ConfigError("checkpoint.new_stage: a weights-only start (checkpoint.load_only) is a new run, not a "
                              "new stage of one; leave one of them out")


def _entry(index: int, entry: Any, after: int, max_steps: int | None) -> Stage:
    """Entry ``index`` of ``stages:``, checked: its keys, name, step and what it sets."""
    if not isinstance(entry, dict):
        raise ConfigError(f"stages[{index}]: expected a mapping with name, at_step and set, got {type(entry).__name__}")
    here = where(index, entry.get("name"))
    extra = sorted(str(k) for k in entry if k not in _ENTRY)
    if extra:
        raise ConfigError(f"{here}: unknown key '{extra[0]}' (a stage has name, at_step and set)")
    name, at_step, values = entry.get("name"), entry.get("at_step"), entry.get("set")
    expect(isinstance(name, str) and bool(_NAME.match(name)), f"stages[{index}].name",
           "a name (letters, digits, _ . -; at most 64 characters)", str(name)[:80])
    if isinstance(at_step, bool) or not isinstance(at_step, int) or at_step <= after:
        raise ConfigError(f"{here}.at_step: expected a step after {after} (where the stage before it "
                          f"{'begins' if index else 'begins: the recipe as written, from step 1'}), got "
                          f"{str(at_step)[:40]}" + ("; stages are listed in the order they begin" if index else ""))
    if max_steps is not None and at_step >= max_steps:
        raise ConfigError(f"{here}.at_step: {at_step} is not before step_scheduler.max_steps ({max_steps}): the "
                          "stage would never train")
    if not isinstance(values, dict) or not values:
        raise ConfigError(f"{here}.set: expected a mapping of dotted recipe keys to values "
                          "(step_scheduler.global_batch_size: 64), got " + (f"{type(values).__name__}" if values
                                                                            else "nothing"))
    return Stage(name, at_step, values)


def _check_key(here: str, key: str) -> None:
    """A key a stage may set: in a section of ``_SECTIONS``, and not one of ``_KEPT``."""
    section = key.split(".")[0]
    if section not in _SECTIONS:
        raise ConfigError(f"{here}: '{key}' is not a key a stage may change: a stage keeps what the run's checkpoints "
                          f"are of (the model, tokenizer, LoRA, seed, parallelism, checkpoint folder, algorithm); "
                          f"it may set keys of {', '.join(_SECTIONS)}")
    for kept, why in _KEPT.items():
        if key == kept or kept.startswith(key + "."):
            raise ConfigError(f"{here}: '{key}' is not a key a stage may change: {why}")


def changed_keys(before: Any, after: dict[str, Any], most: int = 64) -> list[str]:
    """The sorted dotted keys (at most ``most``) a stage may change that differ between ``before`` (untrusted) and
    ``after``; a section whose ``_target_`` changed is one key; the run's length is no stage's."""
    found: list[str] = []

    def walk(key: str, a: Any, b: Any) -> None:
        if len(found) >= most or key in _LENGTH:
            return
        if isinstance(a, dict) and isinstance(b, dict) and a.get("_target_") == b.get("_target_"):
            for sub in sorted(set(a) | set(b), key=str):
                walk(f"{key}.{sub}", a.get(sub), b.get(sub))
        elif a != b:
            found.append(key)

    if isinstance(before, dict):
        now = redacted(after)
        for section in _SECTIONS:
            walk(section, before.get(section), now.get(section))
    return sorted(found)
