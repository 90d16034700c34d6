"""Releasing the pinned host blocks after an async save works on every torch the package allows."""

from __future__ import annotations

import types

import torch

from automodel_ckpt.ondisk.formats import sharded


def test_release_pinned_is_a_no_op_where_torch_has_no_host_cache_call(monkeypatch):
    """torch before 2.13 has no ``torch.accelerator.memory.empty_host_cache``: an async save on CUDA must not fail."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.accelerator, "memory", types.SimpleNamespace(), raising=False)
    sharded.release_pinned()  # no AttributeError

    called = []
    monkeypatch.setattr(torch.accelerator, "memory", types.SimpleNamespace(empty_host_cache=lambda: called.append(1)),
                        raising=False)
    sharded.release_pinned()
    assert called == [1]
