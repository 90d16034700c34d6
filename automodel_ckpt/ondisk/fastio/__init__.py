"""Parallel, zero-copy reads and writes of the model and optimizer files, in the formats torch's own DCP writers use.

Anything unusual takes torch's own path for that item (docs/checkpointing.md, docs/benchmarks.md)."""

from automodel_ckpt.ondisk.fastio.common import READ_THREADS, WRITE_THREADS
from automodel_ckpt.ondisk.fastio.optim_state import init_optimizer_state
from automodel_ckpt.ondisk.fastio.readers import ParallelFileSystemReader, ParallelHFReader
from automodel_ckpt.ondisk.fastio.writers import ParallelFileSystemWriter, ParallelSafetensorsWriter

__all__ = ["READ_THREADS", "WRITE_THREADS", "ParallelFileSystemReader", "ParallelFileSystemWriter", "ParallelHFReader",
           "ParallelSafetensorsWriter", "init_optimizer_state"]
