"""Parallel, zero-copy reads and writes of the model and optimizer files, in the formats torch's own DCP writers use.

Each rank writes one file per state folder in the formats torch's readers, ``dcp_to_torch_save`` and
``safetensors`` read; only how the bytes get there changes. Writes: the layout is planned first, then positioned
writes from the tensors' own memory (no serialized copy) by several threads, large files past the page cache
(not on tmpfs), early writeback, one fsync, the checksum from the same memory (``filewrite``); a ``torch_save``
record holds only what ``torch.load`` reads, without a CRC (``records``). Reads: the bytes are located, then read
past the page cache for large files (``directread``), else ``preadv`` into the destination; a piece that is not
one contiguous range, or goes to another dtype or device, goes through a buffer. Anything unusual (transforms,
unknown dtypes or records) takes torch's own path, so nothing changes what can be saved or loaded.
"""

from automodel_ckpt.ondisk.fastio.common import READ_THREADS, WRITE_THREADS
from automodel_ckpt.ondisk.fastio.optim_state import init_optimizer_state
from automodel_ckpt.ondisk.fastio.readers import ParallelFileSystemReader, ParallelHFReader
from automodel_ckpt.ondisk.fastio.writers import ParallelFileSystemWriter, ParallelSafetensorsWriter

__all__ = ["READ_THREADS", "WRITE_THREADS", "ParallelFileSystemReader", "ParallelFileSystemWriter", "ParallelHFReader",
           "ParallelSafetensorsWriter", "init_optimizer_state"]
