"""Sharded model and optimizer state through torch.distributed.checkpoint, in DCP or HF safetensors files."""

from __future__ import annotations

from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter, HuggingFaceStorageWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from automodel_ckpt.checkpoint.safe_load import (
    CachingHFReader,
    SafeFileSystemReader,
    SafeLoadPlanner,
    check_fits,
    load_failure,
    save_failure,
)

SAFETENSORS = "safetensors"
TORCH_SAVE = "torch_save"


def _writer(path: Path, fmt: str):
    if fmt == SAFETENSORS:
        # save_distributed: every rank writes its own shard-0000R-... file holding its local pieces and their
        # offsets; nothing is gathered.
        return HuggingFaceStorageWriter(str(path), save_distributed=True)
    return FileSystemWriter(str(path), sync_files=True)


def _reader(path: Path, fmt: str):
    """Readers that never unpickle code (see ``safe_load``) and read the checkpoint's metadata once."""
    return CachingHFReader(str(path)) if fmt == SAFETENSORS else SafeFileSystemReader(str(path))


def _save(state: dict, path: Path, writer, process_group) -> None:
    try:
        dcp.save(state, storage_writer=writer, process_group=process_group)
    except CheckpointException as exc:  # raised on every rank; one line naming the folder (disk full, ...)
        raise save_failure(exc, path) from None


def _load(state: dict, path: Path, reader, process_group, *, strict_keys: bool) -> None:
    """``dcp.load`` that first checks keys and shapes (``strict_keys``: extra checkpoint keys count too)."""
    metadata = reader.read_metadata()
    if strict_keys:
        check_fits(state, metadata, path)
    try:
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(path), process_group=process_group)
    except CheckpointException as exc:
        raise load_failure(exc, path, state, metadata) from None


def save_model(model: nn.Module, path: Path, fmt: str, process_group=None) -> None:
    _save(get_model_state_dict(model), path, _writer(path, fmt), process_group)


def load_model(model: nn.Module, path: Path, fmt: str, process_group=None) -> None:
    """Load into the model's current sharding (which may differ from the one that saved it)."""
    state = get_model_state_dict(model)
    _load(state, path, _reader(path, fmt), process_group, strict_keys=True)
    set_model_state_dict(model, state)


def save_optimizer(model: nn.Module, optimizer: Optimizer, path: Path, process_group=None) -> None:
    _save(get_optimizer_state_dict(model, optimizer), path, _writer(path, TORCH_SAVE), process_group)


def load_optimizer(model: nn.Module, optimizer: Optimizer, path: Path, process_group=None) -> None:
    state = get_optimizer_state_dict(model, optimizer)  # materialises empty moments to load into
    _load(state, path, _reader(path, TORCH_SAVE), process_group, strict_keys=False)
    set_optimizer_state_dict(model, optimizer, state)


def detect_model_format(path: Path) -> str:
    """Which format a checkpoint's model folder holds."""
    path = Path(path)
    if any(path.glob("*.safetensors")):
        return SAFETENSORS
    return TORCH_SAVE
