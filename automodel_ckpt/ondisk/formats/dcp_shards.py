"""The ``torch_save`` model format: DCP's ``.distcp`` files and their ``.metadata``, the optimizer's format too.

One ``__R_0.distcp`` per rank; exported with ``ckpt-train consolidate``, never inline."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from automodel_ckpt.errors import CheckpointError
from automodel_ckpt.ondisk import bounded, layout
from automodel_ckpt.ondisk.formats.pieces import Piece, ShardSource, SourceTensor
from automodel_ckpt.ondisk.formats.sharded import DCP_FILES, ShardsFormat

logger = logging.getLogger(__name__)

NAME = "torch_save"


class DcpShards(ShardsFormat):
    name = NAME
    files = f"a DCP {layout.DCP_METADATA} file"

    def detect(self, folder: Path) -> bool:
        return (Path(folder) / layout.DCP_METADATA).is_file()

    def storage_writer(self, path: Path, written: Any, *, small_apart: bool = False, **extra: Any):
        return DCP_FILES.storage_writer(path, written, small_apart=small_apart, **extra)

    def storage_reader(self, path: Path, check: Any = None):
        return DCP_FILES.storage_reader(path, check)

    def open_source(self, folder: Path, saved_world_size: int | None = None) -> ShardSource:
        return _open_dcp(Path(folder))


FORMAT = DcpShards()


def _open_dcp(folder: Path) -> ShardSource:
    """The pieces named by ``folder/.metadata`` (restricted unpickler; file names inside ``folder``)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    from automodel_ckpt.ondisk.formats.safe_load import load_dcp_metadata

    where = folder / layout.DCP_METADATA
    metadata = load_dcp_metadata(where)  # entries counted, sizes and chunk boxes checked (safe_load.check_entries)
    storage = metadata.storage_data or {}
    tensors: dict[str, SourceTensor] = {}
    sizes: dict[str, int] = {}
    for name, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            logger.warning("skipping non-tensor entry '%s' of %s", name, folder)
            continue
        tensor = SourceTensor(name, tuple(md.size), md.properties.dtype)
        for chunk in md.chunks:
            info = storage.get(MetadataIndex(name, chunk.offsets))
            if info is None:
                raise CheckpointError(f"damaged DCP metadata in {folder}: no storage entry for a piece of '{name}'")
            rel = str(info.relative_path)  # checked by load_dcp_metadata: plain, inside the folder, regular
            path = folder / rel
            if rel not in sizes:
                try:
                    sizes[rel] = path.stat().st_size
                except FileNotFoundError:
                    raise CheckpointError(f"missing shard file {path}") from None
            if not (bounded.is_count(info.offset) and bounded.is_count(info.length)):
                raise CheckpointError(f"damaged DCP metadata {where}: a piece of '{name}' has no byte range")
            if info.offset + info.length > sizes[rel]:
                raise CheckpointError(f"truncated shard file {path}: holds {sizes[rel]} bytes, needs "
                                      f"{info.offset + info.length}")
            transforms = tuple(getattr(info, "transform_descriptors", None) or ())
            piece = Piece(path, tuple(chunk.offsets), tuple(chunk.sizes), info.offset, info.length, False, transforms)
            if not transforms and info.length < piece.numel * tensor.dtype.itemsize:
                raise CheckpointError(f"damaged DCP metadata {where}: a piece of '{name}' claims {piece.numel} "
                                      f"elements in {info.length} bytes of {path.name}")
            tensor.pieces.append(piece)
        tensors[name] = tensor
    _check_disjoint_bytes(tensors.values(), where)
    files = sorted(folder / n for n in sizes)
    return ShardSource(folder, NAME, tensors, files)


def _check_disjoint_bytes(tensors: Any, where: Path) -> None:
    """No two pieces share bytes of a file: every byte an export writes has bytes of its own in the shards."""
    ranges = sorted((p.file, p.start, p.start + p.length, t.name) for t in tensors for p in t.pieces if p.length)
    for (file_a, _, end, first), (file_b, start, _, second) in zip(ranges, ranges[1:]):
        if file_a == file_b and start < end:
            raise CheckpointError(f"damaged DCP metadata {where}: pieces of '{first}' and '{second}' share bytes "
                                  f"of {file_a.name}")
