"""Parallel, zero-copy reads and writes of the model and optimizer files, in the formats torch's own DCP writers use.

Each rank still writes exactly one file per state folder (``__R_0.distcp`` or ``shard-0000R-model-00001-of-00001
.safetensors``), in the formats ``FileSystemReader`` / ``HuggingFaceStorageReader``, ``dcp_to_torch_save`` and
``safetensors`` read; what changes is how the bytes get there:

* Writes. The file's layout (every record's offset) is planned first, then the bytes go from the tensors' own
  memory straight to the file with positioned writes (``pwritev``) from ``threads`` threads, in chunks of
  ``common.CHUNK``; no serialized copy of the state is built (torch's safetensors writer builds one of the whole shard).
  Files of ``filewrite.DIRECT_MIN`` and more go past the page cache (O_DIRECT, each region gathered into an aligned
  buffer), except on filesystems held in memory (``common.memory_backed``: tmpfs), where the plain write is the
  only copy.
  Writeback of each chunk is started as soon as it is written (``sync_file_range`` on Linux), so the disk works
  while later chunks are copied; one ``fsync`` at the end makes the file durable. The checksum the manifest needs
  is computed from the same memory while the file is written, so sealing the checkpoint does not read it back.
  A ``torch_save`` record is a torch.save zip archive of the tensor holding only the entries ``torch.load`` reads
  (``records.compact_template``: about 0.6 KiB of framing where ``torch.save``'s own is 1.5 KiB), without a CRC-32
  of the tensor's bytes (the manifest's checksum covers the file; ``torch.load`` does not check the CRC).
* Reads. The tensor bytes are located in the file (safetensors header, or the torch.save record's zip entry).
  Files of ``directread.DIRECT_READ_MIN`` and more are read past the page cache (``directread``: page-aligned
  O_DIRECT regions into reused buffers, copied into the tensors by several threads, the files' checksums computed
  from the same buffers when the load verifies them); smaller files, and filesystems that refuse O_DIRECT, with
  ``preadv`` directly into the destination tensor's memory. A requested piece that is not one contiguous byte
  range of the saved tensor (after a change of world size), or goes to another dtype or device, goes through a
  buffer and is copied.
* Optimizer state is materialised for loading without running an optimizer step (``init_optimizer_state``).

Modules: ``common`` (sizes, thread counts, dtype codes, which filesystems are in memory), ``filewrite`` (one file
from tensor memory), ``directread`` (files read past the page cache), ``records`` (the torch.save record format),
``writers`` / ``readers`` (the DCP storage classes), ``optim_state``.

Anything unusual (stream transforms, tensors of an unknown dtype, non-CPU destinations, a record this package does not
recognise) takes torch's own code path for that item, so this package never changes what can be saved or loaded.
"""

from automodel_ckpt.ondisk.fastio.common import READ_THREADS, WRITE_THREADS
from automodel_ckpt.ondisk.fastio.optim_state import init_optimizer_state
from automodel_ckpt.ondisk.fastio.readers import ParallelFileSystemReader, ParallelHFReader
from automodel_ckpt.ondisk.fastio.writers import ParallelFileSystemWriter, ParallelSafetensorsWriter

__all__ = [
    "READ_THREADS",
    "WRITE_THREADS",
    "ParallelFileSystemReader",
    "ParallelFileSystemWriter",
    "ParallelHFReader",
    "ParallelSafetensorsWriter",
    "init_optimizer_state",
]
