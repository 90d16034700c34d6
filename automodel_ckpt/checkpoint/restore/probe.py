"""Whether a checkpoint can be loaded, and is this run's: headers, indexes and the fingerprint read, nothing changed."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from automodel_ckpt.ondisk import layout, manifest
from automodel_ckpt.ondisk.fingerprint import STAGE_KEYS, first_difference
from automodel_ckpt.ondisk.loadcheck import deferred
from automodel_ckpt.ondisk.metadata import read_metadata
from automodel_ckpt.ondisk.formats.safe_load import load_dcp_metadata, load_pt
from automodel_ckpt.ondisk.formats.safetensors_io import read_header
from automodel_ckpt.errors import CheckpointError

#: A run in stages: a checkpoint's metadata -> the fingerprint it must have, and whether resuming it starts a stage.
StageRule = Callable[[dict[str, Any]], tuple[dict[str, Any] | None, bool]]


def probe(path: Path, *, checksums: bool, rank: int, world_size: int,
          warn: Callable[[str], None] | None = None) -> None:
    """Every rank: ``CheckpointError`` if ``path`` cannot be loaded, reading headers and indexes only."""
    path = Path(path)
    manifest.check_before_load(path, checksums=checksums, rank=rank, world_size=world_size, warn=warn,
                               leave=deferred)  # the model and optimizer files: hashed by the load
    if rank == 0:
        for file in sorted(path.rglob("*.safetensors")):
            if _exported(path, file):
                continue
            read_header(file)
        for file in sorted(path.rglob(layout.DCP_METADATA)):
            load_dcp_metadata(file)
        for file in sorted(path.glob("*.pt")):
            _readable_pt(file)
    for file in sorted(path.glob(f"*/*_dp_rank_{rank}.pt")):
        _readable_pt(file)


def _exported(root: Path, file: Path) -> bool:
    """Files of an HF export inside the checkpoint (``model/consolidated``, ``model/merged``): not resume state."""
    parts = file.relative_to(root).parts
    return len(parts) > 2 and parts[1] in (layout.CONSOLIDATED_DIR, layout.MERGED_DIR)


def _readable_pt(file: Path) -> None:
    try:
        load_pt(file)
    except CheckpointError as exc:  # truncated, garbled, a pickle of anything but plain data, no regular file
        raise CheckpointError(f"'{file}' is unreadable: {str(exc).split(': ', 1)[-1]}") from None


def check_same_run(path: Path, fingerprint: dict[str, Any] | None, checkpoint_dir: Path,
                   stages: StageRule | None = None) -> None:
    """``CheckpointError`` when ``path`` belongs to another run; ``stages``: a run in stages' rule."""
    meta = read_metadata(path) or {}
    expected, new_stage = stages(meta) if stages is not None else (fingerprint, False)
    saved = meta.get("fingerprint")
    difference = first_difference(saved, expected, STAGE_KEYS if new_stage else frozenset())
    if difference is None:
        return
    if first_difference(saved, expected, STAGE_KEYS) is None:  # the data, the sequence length or the batch only
        raise CheckpointError(
            f"'{path}' was trained with another recipe: {difference}. To go on with this one as a new stage of the "
            f"run after its step, rerun with --checkpoint.new_stage NAME (docs/stages.md); or use a new "
            f"checkpoint.checkpoint_dir (this one: '{checkpoint_dir}')")
    raise CheckpointError(
        f"'{path}' is a checkpoint of another run: {difference}. Use a new checkpoint.checkpoint_dir (this one: "
        f"'{checkpoint_dir}'), or start from its weights with checkpoint.restore_from={path} and "
        "checkpoint.load_only=[model]"
    )
