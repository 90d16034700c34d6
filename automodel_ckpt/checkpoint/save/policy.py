"""What a save decides from the configuration and the run folder: export now or not, and whether it is the new best."""

from __future__ import annotations

import warnings
from pathlib import Path

from automodel_ckpt.ondisk.metadata import read_metadata
from automodel_ckpt.ondisk.formats import registry
from automodel_ckpt.ondisk.info import SaveInfo
from automodel_ckpt.checkpoint.save.settings import WriteSettings
from automodel_ckpt.checkpoint.storage.base import RunFolder


class SavePolicy:
    """``checkpoint.save_consolidated`` and ``checkpoint.monitor`` applied to one save; each warning said once."""

    def __init__(self, settings: WriteSettings, *, is_main: bool) -> None:
        self.settings = settings
        self.is_main = is_main
        self._warned: set[str] = set()

    def consolidate_now(self, info: SaveInfo) -> bool:
        """Whether this save of a full model exports a Hugging Face folder inline (``save_consolidated``). An
        adapter is never exported: its folder is Hugging Face-ready already (``ckpt-train merge-lora`` merges it)."""
        mode = self.settings.save_consolidated
        wanted = mode == "every" or (mode == "final" and info.is_final)
        if not wanted:
            return False
        if not registry.get(self.settings.model_save_format).exports_inline:
            exporting = " or ".join(fmt.name for fmt in registry.formats() if fmt.exports_inline)
            self.warn_once("consolidation", f"checkpoint.save_consolidated={mode} needs model_save_format="
                           f"{exporting}; skipping the inline HF export (run `ckpt-train consolidate CHECKPOINT` "
                           "later to export this checkpoint)")
            return False
        return True

    def warn_once(self, what: str, message: str) -> None:
        """On rank 0, the first time only."""
        if self.is_main and what not in self._warned:
            self._warned.add(what)
            warnings.warn(message, stacklevel=3)

    def is_new_best(self, run: RunFolder, staged: Path) -> bool:
        """Rank 0: whether the staged checkpoint beats the run's best so far by ``checkpoint.monitor``.

        Both values are read from the checkpoints' metadata on disk, so a restarted run compares against the best
        of every earlier run. LOWEST_VAL means "best by monitor": with ``mode: max`` it follows the highest value.
        Non-finite values never win.
        """
        best = run.best()
        return run.monitor.beats(read_metadata(staged), read_metadata(best) if best else None)
