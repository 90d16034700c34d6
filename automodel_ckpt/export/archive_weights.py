"""Reading the weights of an archive in place: DCP's metadata from its members' safetensors headers, reads at offsets.

``ArchiveHFReader`` is ``ParallelHFReader`` for an archive: a tensor piece is read straight into its destination at
``member offset + data start + its offset``, nothing extracted. The archive and every header are checked first: a
member or a tensor range outside the archive is refused in one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta,
                                                   TensorProperties, TensorStorageMetadata)

from automodel_ckpt.distributed.dcp_private import hf_storage_info
from automodel_ckpt.export.archive import open_archive
from automodel_ckpt.ondisk import ParallelHFReader, ST_CODES, read_safetensors, tensor_entries
from automodel_ckpt.errors import CheckpointError

_WEIGHTS_SUFFIX = ".safetensors"


class ArchiveHFReader(ParallelHFReader):
    """A Hugging Face folder packed in an archive, read in place (see the module docstring)."""

    def __init__(self, path: str | Path, **kwargs: Any) -> None:
        super().__init__(str(path), **kwargs)
        self.archive_path = Path(path)
        self.headers: dict[str, tuple[str, int, dict[str, Any]]] = {}
        with open_archive(self.archive_path) as archive:
            for name in sorted(n for n in archive.members if n.endswith(_WEIGHTS_SUFFIX) and "/" not in n):
                header, start = archive.safetensors_header(name)
                self.headers[name] = (str(self.archive_path), archive.members[name].offset + start, header)
        if not self.headers:
            raise CheckpointError(f"the archive '{self.archive_path}' holds no safetensors weights")
        self._cached = self._metadata()  # what ``read_metadata`` returns: built from the headers, no file listing

    def header(self, path: str) -> tuple[str, int, dict[str, Any]]:
        return self.headers[path]

    def _metadata(self) -> Metadata:
        HFStorageInfo = hf_storage_info()  # noqa: N806 - DCP's class
        tensors: dict[str, TensorStorageMetadata] = {}
        storage: dict[MetadataIndex, Any] = {}
        found_in: dict[str, str] = {}
        for member, (_, _, header) in self.headers.items():
            for name, entry in tensor_entries(header).items():
                dtype = ST_CODES.get(entry["dtype"])
                if dtype is None:
                    raise CheckpointError(f"'{member}' of the archive '{self.archive_path}': tensor '{name}' has "
                                          f"the dtype {entry['dtype']}, which is not read in place")
                if name in found_in:
                    raise CheckpointError(f"the archive '{self.archive_path}' holds tensor '{name}' twice (in "
                                          f"'{found_in[name]}' and '{member}')")
                found_in[name] = member
                shape = torch.Size(entry["shape"])
                zero = torch.Size([0] * len(shape))
                tensors[name] = TensorStorageMetadata(TensorProperties(dtype=dtype), shape,
                                                      [ChunkStorageMetadata(offsets=zero, sizes=shape)])
                storage[MetadataIndex(fqn=name, offset=zero)] = HFStorageInfo(member, shape, dtype)
        metadata = Metadata(state_dict_metadata=tensors, storage_data=storage)  # type: ignore[arg-type]
        metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        done = read_safetensors(self, plan, planner, self.threads)
        if done is None:
            raise CheckpointError(f"the archive '{self.archive_path}' holds a tensor that is not read in place")
        return done
