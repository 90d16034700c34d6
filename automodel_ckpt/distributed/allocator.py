"""Host memory that training frees goes back to the OS (glibc's thresholds pinned) or, for a model that fits, is kept.

Why, the numbers, and a user's own settings winning: docs/large-models.md.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Mapping, MutableMapping

OPT_OUT_ENV = "AUTOMODEL_CKPT_MALLOC"
M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
THRESHOLD_BYTES = 1024 * 1024  # 128 KiB (glibc's start) returns as much but maps small models' temporaries anew each step
KEEP_TRIM_BYTES = 2**31 - 1  # mallopt takes an int: the most free memory at the heap's top it can be told to keep
TORCH_THP_ENV = "THP_MEM_ALLOC_ENABLE"  # read by torch at its first CPU allocation (c10's alloc_cpu)
THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"


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
    return _mallopt({M_MMAP_THRESHOLD: THRESHOLD_BYTES, M_TRIM_THRESHOLD: THRESHOLD_BYTES}, environ)


def keep_freed_memory(environ: Mapping[str, str] = os.environ) -> bool:
    """Every block from the heap (``M_MMAP_MAX`` 0), trimmed only past ``KEEP_TRIM_BYTES`` free at its top, unless
    the user chose otherwise; whether it did. A step's freed blocks then serve the next step."""
    return _mallopt({M_MMAP_MAX: 0, M_TRIM_THRESHOLD: KEEP_TRIM_BYTES}, environ)


def _mallopt(settings: Mapping[int, int], environ: Mapping[str, str]) -> bool:
    """glibc's ``mallopt`` for each of ``settings`` (parameter: value); whether every one took."""
    if not sys.platform.startswith("linux") or user_allocator_setting(environ) is not None:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process runs on
    except (OSError, AttributeError):  # not glibc (musl has no mallopt): its own policy stays
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all([bool(mallopt(param, value)) for param, value in settings.items()])  # each one set, whatever took


def transparent_huge_pages(mode_file: str = THP_MODE_FILE) -> str | None:
    """The kernel's transparent-huge-page mode (``always``, ``madvise``, ``never``); None without THP."""
    try:
        with open(mode_file, encoding="ascii") as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def huge_pages_for_tensors(environ: MutableMapping[str, str] = os.environ, mode_file: str = THP_MODE_FILE) -> bool:
    """Set ``THP_MEM_ALLOC_ENABLE=1`` in ``environ`` (before the first tensor) where the kernel gives ``madvise``d
    memory huge pages and the user set nothing; whether it did."""
    if not sys.platform.startswith("linux") or TORCH_THP_ENV in environ or user_allocator_setting(environ) is not None:
        return False
    if transparent_huge_pages(mode_file) not in ("always", "madvise"):
        return False
    environ[TORCH_THP_ENV] = "1"
    return True
