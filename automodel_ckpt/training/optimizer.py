"""Which implementation a torch optimizer runs: the fastest the device has, unless the recipe names one.

torch's fused kernels where it has them (the HF Trainer's default), else its default; it never changes the state,
so a checkpoint of one implementation resumes under another.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import Any

import torch

_FUSED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)  # torch's fused kernels
_FUSED_DTENSOR = (torch.optim.Adam, torch.optim.AdamW)

def implementation(target: Any, settings: Mapping[str, Any], params: Iterable[torch.Tensor]) -> tuple[dict, str]:
    """The keyword arguments that choose ``target``'s implementation for ``params`` (none when the recipe set
    ``fused`` or ``foreach`` itself, or the optimizer takes neither), and the start line saying which runs."""
    name = getattr(target, "__name__", str(target))
    try:
        takes = set(inspect.signature(target).parameters)
    except (TypeError, ValueError):
        takes = set()
    chosen = {k: settings[k] for k in ("fused", "foreach") if settings.get(k) is not None}
    if chosen:
        which = "fused" if chosen.get("fused") else "foreach" if chosen.get("foreach") else "single-tensor"
        return {}, f"Optimizer: {name}, {which} implementation (set by optimizer.{'/'.join(chosen)})"
    if "fused" in takes and _fused_supported(target, list(params)):
        return {"fused": True}, (f"Optimizer: {name}, fused implementation (the fastest this device has; "
                                 "optimizer.fused: false or optimizer.foreach choose another)")
    if "foreach" in takes:
        return {"foreach": True}, f"Optimizer: {name}, foreach implementation (no fused kernel for these parameters)"
    return {}, f"Optimizer: {name}"


def _fused_supported(target: Any, params: list[torch.Tensor]) -> bool:
    """Whether torch has a fused ``target`` for every parameter (floating point, one supported device type)."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    if not params or target not in _FUSED:
        return False
    if any(hasattr(p, "device_mesh") for p in params) and target not in _FUSED_DTENSOR:
        return False  # sharded (DTensor) parameters: only these fused kernels have a sharding rule in torch
    devices = {p.device.type for p in params}
    return (len(devices) == 1 and devices <= set(_get_fused_kernels_supported_devices())
            and all(torch.is_floating_point(p) for p in params))
