"""DCP storage writers (``.distcp`` and safetensors shards, one file per rank) that write with ``write_file``."""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Any, Callable

import torch
from torch.distributed.checkpoint import FileSystemWriter, HuggingFaceStorageWriter
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from automodel_ckpt.distributed.dcp_private import StorageInfo, hf_file_name, hf_shard_metadata
from automodel_ckpt.ondisk import durable, layout
from automodel_ckpt.ondisk.incremental import Reuse
from automodel_ckpt.ondisk.fastio.common import ST_DTYPES, WRITE_THREADS, compact, default_threads
from automodel_ckpt.ondisk.fastio import metafile
from automodel_ckpt.ondisk.fastio.filewrite import Lazy, piece_length, write_file
from automodel_ckpt.ondisk.fastio.records import note_location, torch_save_bytes, torch_save_pieces

def _done(results: list[WriteResult]) -> Future:
    fut: Future = Future()
    fut.set_result(results)
    return fut


SMALL_ITEM_BYTES = 64 << 10  # ``small_apart``: tensors below this many bytes go to the small items' file


def _small(item: Any) -> bool:
    """A plain value, or a tensor (piece) below ``SMALL_ITEM_BYTES``."""
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return True
    return math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize < SMALL_ITEM_BYTES


class ParallelFileSystemWriter(FileSystemWriter):
    """``FileSystemWriter`` (one ``.distcp`` file per rank) written by ``write_file``, the small items first.
    ``small_apart``: those in ``__R_1.distcp`` (every rank reads them, and a load that checks each file it reads
    then hashes that small file, not the large one)."""

    def __init__(self, path: str | os.PathLike, *, threads: int = WRITE_THREADS,
                 written: durable.WrittenFiles | None = None, small_apart: bool = False,
                 stable: Callable[[str], bool] | None = None, reuse: Reuse | None = None) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1)
        self.threads = default_threads(threads)
        self.written = written
        self.small_apart = small_apart
        self.stable, self.reuse = stable, reuse  # ``checkpoint.incremental``: the stable items apart, maybe linked

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        if self.transforms.extensions or not self.single_file_per_rank:
            return super().write_data(plan, planner)
        # plain values, small tensors, then the large: what every rank reads of another's file is one read
        small, large = [], []
        for wi in plan.items:
            (small if _small(wi) else large).append(wi)
        small.sort(key=lambda wi: wi.type != WriteItemType.BYTE_IO)  # stable: the values, then the small tensors
        items = small + large
        files = [items]  # __R_0.distcp, and with ``small_apart`` __R_1.distcp
        if self.small_apart and small and large:
            files = [large, small]
        numbered = list(enumerate(files))
        if self.stable is not None:  # the tensors that did not train: a file of their own (``ondisk.incremental``)
            stable = [self.stable(wi.index.fqn) for wi in items]
            if any(stable) and not all(stable):
                numbered = [(0, [wi for wi, s in zip(items, stable) if not s]),
                            (layout.STABLE_DCP_INDEX, [wi for wi, s in zip(items, stable) if s])]
            elif all(stable):
                numbered = [(layout.STABLE_DCP_INDEX, items)]
        results: list[WriteResult] = []
        for k, file_items in numbered:
            reuse = self.reuse if k == layout.STABLE_DCP_INDEX and self.stable is not None else None
            results += self._write_file(f"{plan.storage_data.prefix}{k}{DEFAULT_SUFFIX}", file_items, planner, reuse)
        return _done(results)

    def _write_file(self, file_name: str, items: list[Any], planner: SavePlanner,
                    reuse: Reuse | None = None) -> list[WriteResult]:
        pieces: list[Any] = []
        results: list[WriteResult] = []
        offset = 0
        for item in items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                record = [bytes(data.getbuffer())]
            else:
                tensor = data.detach()
                record = torch_save_pieces(tensor) or [torch_save_bytes(compact(tensor))]
            length = sum(piece_length(p) for p in record)
            pieces += record
            # where the tensor's bytes lie in the record, so that a load need not look inside it
            info = note_location(StorageInfo(file_name, offset, length), record)
            results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=info))
            offset += length
        _write_or_link(reuse, Path(self.fs.concat_path(self.path, file_name)), pieces, self.threads, self.written)
        return results

    def finish(self, metadata: Any, results: list[list[WriteResult]]) -> None:
        self.finish_kept(metadata, lambda: results, None, None)

    def finish_kept(self, metadata: Any, results: Callable[[], list[list[WriteResult]]], key: str | None,
                    stamp: tuple[str, ...] | None, rows: Callable[[], Any] | None = None) -> None:
        """``FileSystemWriter.finish``, the ``.metadata``'s body kept across saves under ``key`` (``metafile``)."""
        from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

        metadata.version = CURRENT_DCP_VERSION
        data, kept = metafile.body(metadata, results, key, stamp, rows)
        path = Path(self._get_metadata_path(None if self.use_collectives else self.rank))
        metafile.write(path, data, metafile.tail(self.storage_meta()), sync=self.sync_files, threads=self.threads,
                       written=self.written)
        kept()


class ParallelSafetensorsWriter(HuggingFaceStorageWriter):
    """``HuggingFaceStorageWriter(save_distributed=True)`` written by ``write_file``: the same header as torch's."""

    def __init__(self, path: str | os.PathLike, *, threads: int = WRITE_THREADS,
                 written: durable.WrittenFiles | None = None, stable: Callable[[str], bool] | None = None,
                 reuse: Reuse | None = None) -> None:
        super().__init__(str(path), save_distributed=True)
        self.threads = default_threads(threads)
        self.written = written
        # ``checkpoint.incremental``: every rank writes two shards, the trained tensors' (00001-of-00002) and the
        # stable ones' (00002-of-00002, maybe linked from the previous checkpoint); either may hold no tensor
        self.stable, self.reuse = stable, reuse

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        storage_data = plan.storage_data or {}
        if (not plan.items or "fqn_to_index_mapping" in storage_data or self.enable_consolidation
                or any(wi.type == WriteItemType.BYTE_IO for wi in plan.items)):
            return super().write_data(plan, planner)
        tensors = [(wi, planner.resolve_data(wi).detach()) for wi in plan.items]
        if any(t.dtype not in ST_DTYPES or t.layout != torch.strided for _, t in tensors):
            return super().write_data(plan, planner)
        shard = storage_data.get("shard_index")
        if self.stable is None:
            return _done(self._write_shard(hf_file_name(1, 1, shard), tensors))
        parts = layout.INCREMENTAL_SHARDS
        trained = [e for e in tensors if not self.stable(e[0].index.fqn)]
        stable = [e for e in tensors if self.stable(e[0].index.fqn)]
        results = self._write_shard(hf_file_name(1, parts, shard), trained)
        return _done(results + self._write_shard(hf_file_name(2, parts, shard), stable, self.reuse))

    def _write_shard(self, file_name: str, tensors: list[tuple[Any, torch.Tensor]],
                     reuse: Reuse | None = None) -> list[WriteResult]:
        """One safetensors shard of ``tensors`` (write items and their data), in torch's writer's format."""
        tensors = sorted(tensors, key=lambda e: (-e[1].element_size(), e[0].index.fqn))
        header: dict[str, Any] = {"__metadata__": hf_shard_metadata(
            json.dumps({wi.index.fqn: {"saved_offsets": list(wi.tensor_data.chunk.offsets)} for wi, _ in tensors}))}
        offset = 0
        for wi, t in tensors:
            n = t.numel() * t.element_size()
            header[wi.index.fqn] = {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
            offset += n
        head = json.dumps(header, separators=(",", ":")).encode("utf-8")
        head += b" " * (-len(head) % 8)
        pieces: list[Any] = [struct.pack("<Q", len(head)) + head]
        results = []
        for wi, t in tensors:
            begin = header[wi.index.fqn]["data_offsets"][0]
            pieces.append(Lazy(t))
            results.append(WriteResult(index=wi.index, size_in_bytes=piece_length(pieces[-1]),
                                       storage_data=StorageInfo(file_name, 8 + len(head) + begin, piece_length(pieces[-1]))))
        _write_or_link(reuse, Path(self.fs.concat_path(self.path, file_name)), pieces, self.threads, self.written)
        return results


def _write_or_link(reuse: Reuse | None, path: Path, pieces: list[Any], threads: int,
                   written: durable.WrittenFiles | None) -> None:
    """``write_file``; with ``reuse``, a hard link to the previous checkpoint's identical file instead, if any."""
    if reuse is None:
        write_file(path, pieces, threads, written)
    else:
        reuse.write(path, pieces, threads, written)

