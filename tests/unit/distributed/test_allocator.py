"""distributed/allocator.py: glibc's thresholds are pinned unless the user chose the allocator's behaviour."""

from __future__ import annotations

import sys

import pytest

from automodel_ckpt.distributed.allocator import OPT_OUT_ENV, return_freed_memory, user_allocator_setting


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
