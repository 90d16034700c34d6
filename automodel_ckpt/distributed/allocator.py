"""Host memory that training frees goes back to the OS: glibc's mmap and trim thresholds, pinned at worker start.

glibc serves a block of at least ``M_MMAP_THRESHOLD`` bytes with its own mapping, unmapped when freed, and the
rest from its heaps, which shrink only from the top. The threshold starts at 128 KiB but rises to the size of
each mapped block that is freed (up to 32 MiB), so after the first large tensor is freed the following gathered
blocks, gradients and staging buffers land on the heap and stay resident when freed. ``return_freed_memory``
pins both thresholds at 1 MiB (``mallopt``), which also stops them adapting (docs/large-models.md has the numbers).

A user's own allocator settings win: with ``LD_PRELOAD`` (jemalloc, tcmalloc), any ``MALLOC_*`` variable or
``glibc.malloc`` tunables in ``GLIBC_TUNABLES`` set, nothing is changed. ``AUTOMODEL_CKPT_MALLOC=default`` keeps
glibc's adaptive thresholds too (to compare).
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Mapping

OPT_OUT_ENV = "AUTOMODEL_CKPT_MALLOC"
M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
THRESHOLD_BYTES = 1024 * 1024  # 128 KiB (glibc's start) returns as much but maps small models' temporaries anew each step


def user_allocator_setting(environ: Mapping[str, str] = os.environ) -> str | None:
    """The variable through which the user chose the allocator's behaviour, if any."""
    if environ.get(OPT_OUT_ENV, "").strip().lower() == "default":
        return OPT_OUT_ENV
    if environ.get("LD_PRELOAD", "").strip():
        return "LD_PRELOAD"
    for name in sorted(environ):
        if name.startswith("MALLOC_"):
            return name
    if "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    return None


def return_freed_memory(environ: Mapping[str, str] = os.environ) -> bool:
    """Pin glibc's mmap and trim thresholds at ``THRESHOLD_BYTES``, unless the user chose otherwise; whether it did."""
    if not sys.platform.startswith("linux") or user_allocator_setting(environ) is not None:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process runs on
    except (OSError, AttributeError):  # not glibc (musl has no mallopt): its own policy stays
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, THRESHOLD_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, THRESHOLD_BYTES))
