"""Host memory that training frees goes back to the OS (glibc's thresholds pinned) or, for a model that fits, is kept.

glibc serves a block of at least ``M_MMAP_THRESHOLD`` bytes with its own mapping, unmapped when freed, and the
rest from its heaps, which shrink only from the top. The threshold starts at 128 KiB but rises to the size of
each mapped block that is freed (up to 32 MiB), so after the first large tensor is freed the following gathered
blocks, gradients and staging buffers land on the heap and stay resident when freed. ``return_freed_memory``
pins both thresholds at 1 MiB (``mallopt``), which also stops them adapting (docs/large-models.md has the numbers).

Memory returned to the OS is faulted in again by the next step, one 4 KiB page at a time: pinned, a step took
about 1.25 x the CPU time of glibc's adaptive thresholds. ``huge_pages_for_tensors`` turns on torch's own
transparent-huge-page allocation (``THP_MEM_ALLOC_ENABLE``: tensors of 2 MiB and more ``madvise``d as huge pages)
before the process allocates its first tensor, so those blocks are faulted in 2 MiB at a time: an eighth of the
faults, and the step's time of the adaptive thresholds with the pinned thresholds' peak.

That is the price of the least memory, worth it where the model is sharded because it barely fits. A model that
fits each rank with room to spare (replicated or unwrapped, ``distributed.data_parallel``) takes
``keep_freed_memory`` instead once the recipe knows it: no block gets a mapping of its own (``M_MMAP_MAX`` 0, not
even those above the 32 MiB that glibc's adaptive threshold stops at: the logits of a step and their gradient, a
large vocabulary's embedding gradient) and the heap is trimmed only past 2 GiB free at its top, so a step's freed
blocks serve the next step from the heap instead of being faulted in again 4 KiB at a time (the pinned thresholds
cost such a run about 1.2 x its step time; glibc's adaptive ones 1.05 x (120M Llama) to 1.1 x (26M), at 1.02 x to
1.07 x the peak resident memory; tools/bench_train.py, docs/benchmarks.md).

A user's own allocator settings win: with ``LD_PRELOAD`` (jemalloc, tcmalloc), any ``MALLOC_*`` variable or
``glibc.malloc`` tunables in ``GLIBC_TUNABLES`` set, nothing is changed (nor with ``THP_MEM_ALLOC_ENABLE`` set:
torch's setting is the user's). ``AUTOMODEL_CKPT_MALLOC=default`` keeps glibc's adaptive thresholds and torch's
default page size too (to compare).
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
    """Every block from the heap (``M_MMAP_MAX`` 0), the heap trimmed only past ``KEEP_TRIM_BYTES`` free at its top,
    unless the user chose otherwise; whether it did.

    For a model that fits each rank with room to spare (replicated or unwrapped: ``distributed.data_parallel``) a
    step's freed blocks, the largest included, then stay on the heap for the next step instead of being faulted in
    again at every step (the module's docstring has the numbers)."""
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
    """Set ``THP_MEM_ALLOC_ENABLE=1`` in ``environ`` (before the process's first tensor, inherited by its workers)
    where the kernel gives ``madvise``d memory huge pages and the user chose no allocator setting; whether it did."""
    if not sys.platform.startswith("linux") or TORCH_THP_ENV in environ or user_allocator_setting(environ) is not None:
        return False
    if transparent_huge_pages(mode_file) not in ("always", "madvise"):
        return False
    environ[TORCH_THP_ENV] = "1"
    return True
