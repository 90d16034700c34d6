"""distributed/allocator.py: glibc's thresholds pinned and torch's huge pages on, unless the user chose otherwise."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap

import pytest

from automodel_ckpt.distributed.allocator import (OPT_OUT_ENV, TORCH_THP_ENV, huge_pages_for_tensors,
                                                  keep_freed_memory, return_freed_memory, transparent_huge_pages,
                                                  user_allocator_setting)


@pytest.mark.parametrize(("environ", "chosen_by"), [
    ({}, None),
    ({"PATH": "/usr/bin", "GLIBC_TUNABLES": "glibc.pthread.rseq=0"}, None),
    ({OPT_OUT_ENV: "default"}, OPT_OUT_ENV),
    ({OPT_OUT_ENV: "pinned"}, None),
    ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, "LD_PRELOAD"),
    ({"LD_PRELOAD": "  "}, None),
    ({"MALLOC_ARENA_MAX": "2"}, "MALLOC_ARENA_MAX"),
    ({"MALLOC_MMAP_THRESHOLD_": "1048576"}, "MALLOC_MMAP_THRESHOLD_"),
    ({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1048576"}, "GLIBC_TUNABLES"),
])  # fmt: skip
def test_a_users_own_allocator_setting_is_found(environ, chosen_by):
    assert user_allocator_setting(environ) == chosen_by


@pytest.mark.parametrize("environ", [{OPT_OUT_ENV: "default"}, {"LD_PRELOAD": "libtcmalloc.so"},
                                     {"MALLOC_TRIM_THRESHOLD_": "0"}])
def test_nothing_is_changed_when_the_user_chose(environ, monkeypatch):
    import ctypes

    monkeypatch.setattr(ctypes, "CDLL", lambda *a, **k: pytest.fail("the C library was called"))
    assert return_freed_memory(environ) is False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_the_thresholds_are_pinned_otherwise():
    assert return_freed_memory({}) is True


@pytest.mark.parametrize(("text", "mode"), [("always [madvise] never\n", "madvise"), ("[always] madvise never", "always"),
                                            ("always madvise [never]", "never"), ("", None)])
def test_the_kernels_huge_page_mode_is_read(tmp_path, text, mode):
    (tmp_path / "enabled").write_text(text)
    assert transparent_huge_pages(str(tmp_path / "enabled")) == mode
    assert transparent_huge_pages(str(tmp_path / "absent")) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages")
@pytest.mark.parametrize(("mode", "environ", "turned_on"), [
    ("always [madvise] never", {}, True),
    ("[always] madvise never", {"PATH": "/usr/bin"}, True),
    ("always madvise [never]", {}, False),
    (None, {}, False),
    ("always [madvise] never", {TORCH_THP_ENV: "0"}, False),
    ("always [madvise] never", {OPT_OUT_ENV: "default"}, False),
    ("always [madvise] never", {"LD_PRELOAD": "libjemalloc.so.2"}, False),
])  # fmt: skip
def test_torchs_huge_pages_are_turned_on_unless_the_user_or_the_kernel_says_otherwise(tmp_path, mode, environ,
                                                                                      turned_on):
    mode_file = tmp_path / "enabled"
    if mode is not None:
        mode_file.write_text(mode)
    before = dict(environ)
    assert huge_pages_for_tensors(environ, str(mode_file)) is turned_on
    assert environ == ({**before, TORCH_THP_ENV: "1"} if turned_on else before)


_FAULTS = textwrap.dedent("""
    import os, resource, sys
    from automodel_ckpt.distributed.allocator import huge_pages_for_tensors, return_freed_memory
    if sys.argv[1] == "on":
        assert huge_pages_for_tensors(os.environ)
    return_freed_memory()
    import torch
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(8):
        torch.ones(16 << 20)  # 64 MiB, mapped and unmapped again with the thresholds pinned
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


@pytest.mark.skipif(transparent_huge_pages() not in ("always", "madvise"), reason="the kernel gives no huge pages")
def test_with_huge_pages_a_large_tensor_is_faulted_in_2_mib_at_a_time():
    """Pinned thresholds unmap a freed tensor, so the next one is faulted in anew: 4 KiB at a time without torch's
    huge pages (16,384 faults per 64 MiB), a few dozen with them."""
    def faults(mode: str) -> int:
        env = {k: v for k, v in os.environ.items() if k not in (TORCH_THP_ENV, OPT_OUT_ENV)
               and user_allocator_setting({k: v}) is None}  # the thresholds pinned in both runs
        out = subprocess.run([sys.executable, "-c", _FAULTS, mode], env=env, capture_output=True, text=True, check=True)
        return int(out.stdout.split()[-1])

    pages = 8 * (64 << 20) // 4096
    assert faults("off") > pages // 2
    assert faults("on") < pages // 8


_MAPPED = textwrap.dedent("""
    import ctypes, sys
    from automodel_ckpt.distributed import allocator

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                         "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.mallinfo2.restype = ctypes.c_void_p, MallInfo2
    assert getattr(allocator, sys.argv[1])()
    before = libc.mallinfo2().hblks  # blocks glibc mapped on their own (unmapped, and faulted in again, once freed)
    block = libc.malloc(int(sys.argv[2]) << 20)  # MiB: 8, a block of a small model's step; 256, a step's logits
    print(libc.mallinfo2().hblks - before)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(ctypes.CDLL(None), "mallinfo2"),
                    reason="glibc >= 2.33's mallinfo2")
def test_a_model_that_fits_keeps_freed_blocks_for_the_next_step():
    """Pinned thresholds give an 8 MiB block a mapping of its own (unmapped when freed, faulted in again by the next
    step); kept ones (glibc's settled adaptive thresholds) serve it from the heap, where a freed block stays."""
    def mapped(how: str, mib: int = 8) -> int:
        env = {k: v for k, v in os.environ.items() if user_allocator_setting({k: v}) is None}
        out = subprocess.run([sys.executable, "-c", _MAPPED, how, str(mib)], env=env, capture_output=True, text=True,
                             check=True)
        return int(out.stdout.split()[-1])

    assert mapped("return_freed_memory") == 1
    assert mapped("keep_freed_memory") == 0
    assert mapped("return_freed_memory", 256) == 1
    assert mapped("keep_freed_memory", 256) == 0  # the largest blocks too (above glibc's 32 MiB mmap threshold)
    assert keep_freed_memory({"LD_PRELOAD": "libtcmalloc.so"}) is False  # the user's allocator stays
