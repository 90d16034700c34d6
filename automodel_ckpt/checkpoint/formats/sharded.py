"""Sharded model and optimizer state through torch.distributed.checkpoint, in DCP or HF safetensors files."""

from __future__ import annotations

from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter, HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

SAFETENSORS = "safetensors"
TORCH_SAVE = "torch_save"


def _writer(path: Path, fmt: str):
    if fmt == SAFETENSORS:
        # save_distributed: every rank writes its own shard-0000R-... file holding its local pieces and their
        # offsets; nothing is gathered.
        return HuggingFaceStorageWriter(str(path), save_distributed=True)
    return FileSystemWriter(str(path), sync_files=True)


def _reader(path: Path, fmt: str):
    return HuggingFaceStorageReader(str(path)) if fmt == SAFETENSORS else FileSystemReader(str(path))


def save_model(model: nn.Module, path: Path, fmt: str, process_group=None) -> None:
    dcp.save(get_model_state_dict(model), storage_writer=_writer(path, fmt), process_group=process_group)


def load_model(model: nn.Module, path: Path, fmt: str, process_group=None) -> None:
    """Load into the model's current sharding (which may differ from the one that saved it)."""
    state = get_model_state_dict(model)
    dcp.load(state, storage_reader=_reader(path, fmt), process_group=process_group)
    set_model_state_dict(model, state)


def save_optimizer(model: nn.Module, optimizer: Optimizer, path: Path, process_group=None) -> None:
    dcp.save(get_optimizer_state_dict(model, optimizer), storage_writer=_writer(path, TORCH_SAVE), process_group=process_group)


def load_optimizer(model: nn.Module, optimizer: Optimizer, path: Path, process_group=None) -> None:
    state = get_optimizer_state_dict(model, optimizer)  # materialises empty moments to load into
    dcp.load(state, storage_reader=_reader(path, TORCH_SAVE), process_group=process_group)
    set_optimizer_state_dict(model, optimizer, state)


def detect_model_format(path: Path) -> str:
    """Which format a checkpoint's model folder holds."""
    path = Path(path)
    if any(path.glob("*.safetensors")):
        return SAFETENSORS
    return TORCH_SAVE
