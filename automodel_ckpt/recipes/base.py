"""The recipe contract (``__init__(cfg)``, ``run()``) and the state discovery and save/restore hooks it shares."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from omegaconf import DictConfig

from automodel_ckpt.checkpoint import Checkpointer, CheckpointConfig, discover_state


class BaseRecipe:
    """What `ckpt-train` runs: ``recipe: my_pkg.MyRecipe`` in the YAML names a subclass.

    The contract: every rank constructs the class with the validated config (``MyRecipe(cfg)``: an OmegaConf
    node of the recipe schema, cheap to build, no process group yet) and calls ``run()`` once; ``run`` trains to
    the end (or until preempted) and returns with the last checkpoint complete. Everything else is the
    subclass's choice.

    Checkpointing is by discovery: every public attribute with ``state_dict`` and ``load_state_dict`` is saved
    and restored under its name (``self.my_state = MyState()`` is checkpointed automatically); list attribute
    names in ``checkpoint_exclude`` to keep them out. Build ``self.checkpointer`` (a ``Checkpointer`` from
    ``self.checkpoint_config``) in setup, always: with ``checkpoint.enabled: false`` it saves nothing. The loop
    then makes four calls of it: ``resume`` (``restore_checkpoint``), ``step_end`` after each optimizer step (it
    decides what to save and saves it), ``fence`` before changing saved tensors in place, and ``finalize``.
    """

    checkpoint_exclude: ClassVar[frozenset[str]] = frozenset()
    checkpointer: Checkpointer  # built by the subclass once the process group exists
    restored: Any = None  # what the last restore_checkpoint loaded (``checkpoint.Restored``)

    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.checkpoint_config: CheckpointConfig = CheckpointConfig.from_section(cfg.checkpoint)

    def run(self) -> None:
        """Train; called once on every rank."""
        raise NotImplementedError(f"{type(self).__name__} must implement run()")

    def checkpointed_state(self) -> dict[str, Any]:
        return discover_state(self, exclude=self.checkpoint_exclude)

    def finalize_checkpoints(self) -> Path | None:
        """Complete the checkpoint still being written in the background (``checkpoint.is_async``), if any."""
        return self.checkpointer.finalize()

    def restore_checkpoint(self) -> Path | None:
        """Restore the checkpoint that ``checkpoint.restore_from`` selects (auto: the newest that loads), if any;
        ``self.restored`` says what it loaded (its states, tier and time)."""
        self.restored = self.checkpointer.resume(self.checkpointed_state())
        return self.restored.path
