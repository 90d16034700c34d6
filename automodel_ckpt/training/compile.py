"""``training.compile``: each decoder block compiled by ``torch.compile`` (as torchtitan does), where it pays.

In place (parameter names, hence checkpoints, unchanged) and deterministic, so a resume stays exact. ``auto``: on
CUDA, and on CPU above ``CPU_STEP_FLOP`` a step and ``CPU_RUN_FLOP`` a run, from the configuration alone
(docs/parallelism.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from automodel_ckpt.errors import ConfigError

if TYPE_CHECKING:  # torch loads lazily: the launcher checks the setting without it
    import torch
    from torch import nn

_ON, _OFF = ("true", "on", "yes", "1"), ("false", "off", "no", "0")
#: On CPU, ``auto`` compiles a process's step of at least this many FLOP (``6 x parameters x tokens``) ...
CPU_STEP_FLOP = 1e11
#: ... in a run of at least this many FLOP of such steps, where ``step_scheduler.max_steps`` says its length.
CPU_RUN_FLOP = 3e14


def check(setting: object) -> str:
    """``training.compile`` as ``auto``, ``true`` or ``false``; a one-line ``ConfigError`` for anything else."""
    value = str(setting).strip().lower()
    if value in _ON + _OFF + ("auto",):
        return "true" if value in _ON else "false" if value in _OFF else "auto"
    raise ConfigError(f"training.compile: expected auto, true or false, got '{setting}'")


def step_flop(parameters: int, tokens: int) -> float:
    """A step's matrix work on one process: forward and backward of ``parameters`` over ``tokens`` tokens."""
    return 6.0 * parameters * tokens


def decide(setting: object, device: torch.device, step_work: float = 0.0,
           steps: int | None = None) -> tuple[bool, str]:
    """Whether blocks are compiled, and the start line; ``step_work``: FLOP a step; ``steps``: ``max_steps``."""
    value = check(setting)
    if value != "auto":
        return value == "true", f"torch.compile: {'on' if value == 'true' else 'off'} (training.compile: {value})"
    if device.type == "cuda":
        return True, "torch.compile: on (auto: compiled blocks are faster on CUDA; training.compile: false turns it off)"
    if device.type != "cpu":
        return False, f"torch.compile: off (auto: not measured on {device.type}; training.compile: true turns it on)"
    if step_work < CPU_STEP_FLOP:
        why = f"{step_work:.1e} FLOP a step, below {CPU_STEP_FLOP:.2g}: compiling costs more than it gains"
    elif steps is not None and step_work * steps < CPU_RUN_FLOP:
        why = (f"{step_work * steps:.1e} FLOP over {steps} steps, below {CPU_RUN_FLOP:.2g}: too short a run to repay "
               "compiling")
    else:
        run = f", {step_work * steps:.1e} over {steps} steps" if steps is not None else ""
        return True, (f"torch.compile: on (auto on CPU: {step_work:.1e} FLOP a step{run}: 3 to 5% off each step "
                      "repays a minute of compiling; training.compile: false turns it off)")
    return False, f"torch.compile: off (auto on CPU: {why}; training.compile: true turns it on)"


def compile_blocks(model: nn.Module) -> int:
    """Compile each decoder block of ``model`` in place; returns how many."""
    from automodel_ckpt.distributed.fsdp import decoder_layers

    blocks = [b for b in decoder_layers(model) if any(True for _ in b.parameters())]  # a stage's own layers
    for block in blocks:
        block.compile()
    return len(blocks)
