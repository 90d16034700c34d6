"""What a save adds for Hugging Face readers: the model folder's helper files and the inline export."""

from __future__ import annotations

import shutil
from pathlib import Path

from automodel_ckpt.ondisk import layout
from automodel_ckpt.ondisk.formats.base import ModelFormat
from automodel_ckpt.ondisk.info import HFArtifacts


def write_model_helpers(model_dir: Path, hf: HFArtifacts, fmt: ModelFormat) -> None:
    """Rank 0: config, generation config and tokenizer beside the model's files; ``consolidate.sh`` where the
    model format exports inline (``exports_inline``; the others export with ``ckpt-train consolidate``)."""
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
