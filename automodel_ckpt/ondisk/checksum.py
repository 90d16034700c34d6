"""File checksums for manifests: the algorithms (xxHash3-64, CRC32 as a fallback), hashers, whole files and ranges.

A manifest names its algorithm, so either verifies either. Checksums detect corruption, not deliberate tampering."""

from __future__ import annotations

import mmap
import os
import zlib
from pathlib import Path
from typing import Any

from automodel_ckpt.ondisk import layout, paths
from automodel_ckpt.errors import CheckpointError

XXH3_64 = "xxh3_64"
CRC32 = "crc32"
_CHUNK = 8 << 20
_MMAP_MIN = 1 << 20
_MMAP_CHUNK = 16 << 20
_DROP = getattr(mmap, "MADV_DONTNEED", None)


def default_algorithm() -> str:
    """The algorithm new manifests use: xxh3_64 when ``xxhash`` is installed, else crc32."""
    try:
        import xxhash  # noqa: F401
    except ImportError:
        return CRC32
    return XXH3_64


class _Crc32:
    def __init__(self) -> None:
        self.value = 0

    def update(self, data: Any) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def hasher(algorithm: str) -> Any:
    """A fresh hasher (``update``, ``hexdigest``) for ``algorithm``; a CheckpointError if it is unknown or missing."""
    if algorithm == XXH3_64:
        try:
            import xxhash
        except ImportError:
            raise CheckpointError("this checkpoint's manifest uses xxh3_64 checksums; install the 'xxhash' package "
                                  "to check them") from None
        return xxhash.xxh3_64()
    if algorithm == CRC32:
        return _Crc32()
    raise CheckpointError(f"unknown checksum algorithm '{algorithm}' in {layout.MANIFEST_FILE}")


def hash_file(path: Path, algorithm: str) -> tuple[int, str]:
    """``(bytes read, hex checksum)`` of one regular file (``OSError`` for a symlink, FIFO, device...). Files of
    1 MiB and more are memory-mapped (twice as fast as ``read``), each 16 MiB hashed dropped from the mapping."""
    h = hasher(algorithm)
    size = 0
    with os.fdopen(paths.open_regular(path), "rb", buffering=0) as f:
        length = os.fstat(f.fileno()).st_size
        if length >= _MMAP_MIN:
            try:
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                    view = memoryview(m)
                    try:
                        for start in range(0, len(m), _MMAP_CHUNK):
                            h.update(view[start:start + _MMAP_CHUNK])
                            if _DROP is not None:  # its pages leave this process (the page cache keeps them)
                                m.madvise(_DROP, start, min(_MMAP_CHUNK, len(m) - start))
                    finally:
                        view.release()
                    return len(m), h.hexdigest()
            except (OSError, ValueError):
                h = hasher(algorithm)  # no mmap here: read it instead
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
            size += n
    return size, h.hexdigest()


def hash_range(fd: int, offset: int, size: int, algorithm: str) -> str:
    """The hex checksum of bytes ``[offset, offset + size)`` of the open file ``fd``; ``OSError`` if it ends first."""
    h = hasher(algorithm)
    buf = bytearray(min(_CHUNK, max(size, 1)))
    view = memoryview(buf)
    done = 0
    while done < size:
        n = os.preadv(fd, [view[:min(len(buf), size - done)]], offset + done)
        if n == 0:
            raise OSError(f"the file ends at byte {offset + done}, before the {size} bytes from byte {offset}")
        h.update(view[:n])
        done += n
    return h.hexdigest()
