"""``training.compile``: each decoder block compiled by ``torch.compile`` (as torchtitan does), where it pays.

Blocks are compiled in place (``nn.Module.compile``: the parameter names, hence checkpoints, are unchanged), before
the model is sharded or replicated. Compiling is deterministic for a given model, shapes and machine: a run and its
resume compile the same kernels, so the resume stays exact. ``auto`` compiles on CUDA, where the compiled blocks
run faster from the first steps on; on CPU it does not: there compiling a block costs tens of seconds of the
run's two cores per shape (docs/benchmarks.md, ``tools/bench_train.py``), more than typical runs gain back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from automodel_ckpt.errors import ConfigError

if TYPE_CHECKING:  # torch loads lazily: the launcher checks the setting without it
    import torch
    from torch import nn

_ON, _OFF = ("true", "on", "yes", "1"), ("false", "off", "no", "0")


def check(setting: object) -> str:
    """``training.compile`` as ``auto``, ``true`` or ``false``; a one-line ``ConfigError`` for anything else."""
    value = str(setting).strip().lower()
    if value in _ON + _OFF + ("auto",):
        return "true" if value in _ON else "false" if value in _OFF else "auto"
    raise ConfigError(f"training.compile: expected auto, true or false, got '{setting}'")


def decide(setting: object, device: torch.device) -> tuple[bool, str]:
    """Whether blocks are compiled under ``training.compile`` (``setting``) on ``device``, and the start line."""
    value = check(setting)
    if value != "auto":
        return value == "true", f"torch.compile: {'on' if value == 'true' else 'off'} (training.compile: {value})"
    if device.type == "cuda":
        return True, "torch.compile: on (auto: compiled blocks are faster on CUDA; training.compile: false turns it off)"
    return False, ("torch.compile: off (auto: on CPU compiling costs more than a typical run gains; "
                   "training.compile: true turns it on)")


def compile_blocks(model: nn.Module) -> int:
    """Compile each decoder block of ``model`` in place; returns how many."""
    from automodel_ckpt.distributed.fsdp import decoder_layers

    blocks = [b for b in decoder_layers(model) if any(True for _ in b.parameters())]  # a stage's own layers
    for block in blocks:
        block.compile()
    return len(blocks)
