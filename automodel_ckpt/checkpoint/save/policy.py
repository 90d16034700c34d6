"""What a save decides (export now? the new best?) and adds for Hugging Face readers: helper files, the inline export."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

from automodel_ckpt.ondisk import layout
from automodel_ckpt.ondisk.metadata import read_metadata
from automodel_ckpt.ondisk.formats import registry
from automodel_ckpt.ondisk.formats.base import ModelFormat
from automodel_ckpt.ondisk.info import HFArtifacts, SaveInfo
from automodel_ckpt.checkpoint.save.settings import WriteSettings
from automodel_ckpt.checkpoint.storage.base import RunStorage


class SavePolicy:
    """``checkpoint.save_consolidated`` and ``checkpoint.monitor`` applied to one save; each warning said once."""

    def __init__(self, settings: WriteSettings, *, is_main: bool) -> None:
        self.settings = settings
        self.is_main = is_main
        self._warned: set[str] = set()

    def consolidate_now(self, info: SaveInfo) -> bool:
        """Whether this save exports a Hugging Face folder inline; never an adapter (Hugging Face-ready already)."""
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

    def is_new_best(self, run: RunStorage, staged: Path) -> bool:
        """Rank 0: whether the staged checkpoint beats the best on disk (every launch's) by ``checkpoint.monitor``;
        LOWEST_VAL is "best by monitor" (the highest with ``mode: max``). Non-finite values never win."""
        best = run.best()
        return run.monitor.beats(read_metadata(staged), read_metadata(best) if best else None)


def write_model_helpers(model_dir: Path, hf: HFArtifacts, fmt: ModelFormat) -> None:
    """Rank 0: config, generation config and tokenizer beside the model's files, and ``consolidate.sh`` where the
    format exports inline (the others export with ``ckpt-train consolidate``)."""
    from automodel_ckpt.export import render_consolidate_script, write_hf_metadata

    write_hf_metadata(model_dir, hf_config=hf.hf_config, generation_config=hf.generation_config,
                      tokenizer=hf.tokenizer, base_model_path=hf.base_model_path)
    if fmt.exports_inline:
        render_consolidate_script(model_dir)


def remove_export(model_dir: Path) -> None:
    """Whatever a failed inline export left in ``model_dir``: its folder, its temporary folders."""
    for path in [model_dir / layout.CONSOLIDATED_DIR, *model_dir.glob(layout.export_tmp_name(layout.CONSOLIDATED_DIR,
                                                                                              "*"))]:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)


def export_inline(model_dir: Path, rank: int, world_size: int) -> None:
    """Collective: the checkpoint's model as a Hugging Face folder inside it (``save_consolidated``)."""
    from automodel_ckpt.export import consolidate

    consolidate(model_dir, rank=rank, world_size=world_size, progress=False)
