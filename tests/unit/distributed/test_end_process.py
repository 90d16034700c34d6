"""``env.end_process``: the exit handlers run, but not torch's operator libraries' finalizers (each unregisters its
kernels from the dispatcher, for a process that ``os._exit`` ends next)."""

from __future__ import annotations

import weakref

import torch  # noqa: F401 - its operator libraries are what is counted

from automodel_ckpt.distributed import env


def _library_finalizers() -> list[weakref.finalize]:
    return [f for f in list(weakref.finalize._registry) if (held := f.peek()) is not None
            and getattr(held[1], "__qualname__", "") == "_del_library"]


def test_the_exit_handlers_leave_torchs_operator_libraries_registered():
    handles = _library_finalizers()
    before = [f.atexit for f in handles]
    assert any(before)  # torch registers some at import
    try:
        env._keep_torch_libraries()
        assert not any(f.atexit for f in _library_finalizers())
    finally:  # this process goes on: its own exit is the interpreter's
        for f, was in zip(handles, before):
            f.atexit = was
