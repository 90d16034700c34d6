"""A DCP folder another program wrote (``.metadata`` + ``*.distcp``), read whole into this process's memory.

Without a process group, through ``safe_load``; the tensors' total size is bounded before anything is allocated."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import torch

from automodel_ckpt.errors import CheckpointError, first_line
from automodel_ckpt.ondisk import bounded, paths
from automodel_ckpt.ondisk.formats.safe_load import SafeFileSystemReader, SafeLoadPlanner

SLACK = 1 << 20  # bytes a folder's tensors may claim past its data files' size (empty tensors, headers)


def read_dcp_folder(folder: Path, limit: int | None = None, what: str = "a DCP folder") -> dict[str, Any]:
    """``{flat key: tensor or object}`` of DCP folder ``folder`` (at most ``limit`` bytes, else ``CheckpointError``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    folder = Path(folder)
    reader = SafeFileSystemReader(str(folder))
    metadata = reader.read_metadata()  # restricted unpickler; entries, chunk boxes and file names checked
    stored = 0
    for rel in sorted({str(info.relative_path) for info in (metadata.storage_data or {}).values()}):
        file = paths.path_inside(folder, rel, f"'{folder}'")
        try:
            stored += file.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"'{file}' is missing (named by '{folder}/.metadata')") from None
    if limit is not None:
        bounded.check_size(stored, f"'{folder}' (its data files)", what, limit)
    state: dict[str, Any] = {}
    claimed = 0
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            claimed += math.prod(md.size) * md.properties.dtype.itemsize
        elif not isinstance(md, BytesStorageMetadata):
            raise CheckpointError(f"'{folder}': entry {key[:200]!r} is neither a tensor nor an object")
    if claimed > stored + SLACK:
        raise CheckpointError(f"refusing '{folder}': its metadata claims {claimed} bytes of tensors, its data files "
                              f"hold {stored}")
    for key, md in metadata.state_dict_metadata.items():
        state[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype) \
            if isinstance(md, TensorStorageMetadata) else None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP's note that it loads in one process: it is meant to
            dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(folder), no_dist=True)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - DCP wraps a reader's failure in its own exception types
        raise CheckpointError(f"cannot read the DCP folder '{folder}': {type(exc).__name__}: "
                              f"{first_line(exc)}") from None
    return state
