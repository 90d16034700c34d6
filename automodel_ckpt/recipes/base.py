"""The recipe base class: state discovery and the save/restore hooks every recipe shares."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from automodel_ckpt.checkpoint.checkpointer import Checkpointer, SaveInfo
from automodel_ckpt.checkpoint.state import discover_state


class BaseRecipe:
    """Subclass and add state as attributes: ``self.my_state = MyState()`` is checkpointed automatically.

    Every public attribute with ``state_dict`` and ``load_state_dict`` is saved and restored under its name.
    List attribute names in ``checkpoint_exclude`` to keep them out of checkpoints.
    """

    checkpoint_exclude: ClassVar[frozenset[str]] = frozenset()
    checkpointer: Checkpointer | None = None

    def checkpointed_state(self) -> dict[str, Any]:
        return discover_state(self, exclude=self.checkpoint_exclude)

    def save_checkpoint(self, info: SaveInfo) -> Path | None:
        if self.checkpointer is None:
            return None
        return self.checkpointer.save(self.checkpointed_state(), info)

    def finalize_checkpoints(self) -> Path | None:
        """Complete the checkpoint still being written in the background (``checkpoint.is_async``), if any."""
        if self.checkpointer is None:
            return None
        return self.checkpointer.finalize()

    def restore_checkpoint(self) -> Path | None:
        """Restore the checkpoint that ``checkpoint.restore_from`` selects (auto: the latest), if any."""
        if self.checkpointer is None:
            return None
        path = self.checkpointer.find_restore_target()
        if path is not None:
            self.checkpointer.load(self.checkpointed_state(), path)
        return path
