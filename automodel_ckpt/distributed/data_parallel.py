"""How the data-parallel ranks hold the model (``distributed.dp_shard``): sharded by FSDP2, replicated, or unwrapped.

``auto``'s rule and what each choice costs: docs/parallelism.md. Names, checkpoints and data order are the same.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

from automodel_ckpt.distributed.mesh import MeshSizes, ParallelDims
from automodel_ckpt.errors import ConfigError

if TYPE_CHECKING:  # torch loads lazily: the launcher checks the setting (``check``) without it
    import torch
    from torch import nn
from automodel_ckpt.sizes import human_size

SETTINGS = ("auto", "full", "none")
#: Under ``auto``, the largest share of a rank's memory the replicated state may take and still be replicated.
REPLICATED_SHARE = 0.25
SHARDED, REPLICATED, UNWRAPPED = "sharded with FSDP2", "replicated", "unwrapped"


@dataclass(frozen=True)
class Choice:
    """The data-parallel strategy of a run (``kind``: ``SHARDED``, ``REPLICATED`` or ``UNWRAPPED``) and why."""

    kind: str
    reason: str
    mixed_precision: str | None = None

    @property
    def sharded(self) -> bool:
        return self.kind == SHARDED

    def describe(self) -> str:
        """The start line: which strategy, and why."""
        return f"Data parallelism: {self.kind} ({self.reason})"

    @contextlib.contextmanager
    def compute(self, device: torch.device) -> Iterator[None]:
        """The forward's context: autocast to the mixed-precision dtype where FSDP2 does not cast (else nothing)."""
        dtype = _mp_dtype(self.mixed_precision)
        if self.sharded or dtype is None:
            yield
            return
        import torch

        with torch.autocast(device.type, dtype=dtype):
            yield


def choose(setting: str | None, dims: ParallelDims, model: nn.Module, device: torch.device,
           mixed_precision: str | None = None, memory: int | None = None) -> Choice:
    """The strategy ``distributed.dp_shard`` (``setting``) asks for ``model`` on this mesh, given ``memory``."""
    setting, meshed = check(setting, dims.sizes)
    if setting == "full":
        return Choice(SHARDED, "distributed.dp_shard: full", mixed_precision)
    if meshed:
        return Choice(SHARDED, f"{' and '.join(meshed)} parallelism shards with FSDP2", mixed_precision)
    if dims.dp_size == 1:
        return Choice(UNWRAPPED, "one data-parallel rank: nothing to exchange", mixed_precision)
    if setting == "none":
        return Choice(REPLICATED, "distributed.dp_shard: none", mixed_precision)
    need, have = replicated_bytes(model), memory or rank_memory(device)
    share = f"{human_size(need)} of parameters, gradients and AdamW state, {need / have:.0%} of this rank's " \
            f"{human_size(have)}"
    if need <= REPLICATED_SHARE * have:
        return Choice(REPLICATED, f"auto: {share}; replicated up to {REPLICATED_SHARE:.0%}", mixed_precision)
    return Choice(SHARDED, f"auto: {share}, more than {REPLICATED_SHARE:.0%}", mixed_precision)


def check(setting: str | None, sizes: MeshSizes) -> tuple[str, list[str]]:
    """``distributed.dp_shard`` normalised; a ``ConfigError`` for an unknown value or ``none`` beside other meshes."""
    value = str(setting or "auto").lower()
    if value not in SETTINGS:
        raise ConfigError(f"distributed.dp_shard: expected one of {', '.join(SETTINGS)}, got '{setting}'")
    meshed = [name for name, on in (("tensor", sizes.tp > 1), ("pipeline", sizes.pp > 1), ("expert", sizes.ep > 1),
                                    ("HSDP", sizes.dp_replicate > 1)) if on]
    if meshed and value == "none":
        raise ConfigError(f"distributed.dp_shard: none cannot be combined with {' and '.join(meshed)} "
                          "parallelism, which shards with FSDP2; use auto or full")
    return value, meshed


def replicated_bytes(model: nn.Module) -> int:
    """Bytes a rank holds replicated: every parameter, and per trainable one its gradient and AdamW's moments."""
    return sum(p.numel() * p.element_size() * (4 if p.requires_grad else 1) for p in model.parameters())


def rank_memory(device: torch.device) -> int:
    """The memory one rank may count on: its GPU's, or the machine's (or cgroup's) over this node's processes."""
    if device.type == "cuda":
        import torch

        return int(torch.cuda.get_device_properties(device).total_memory)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = open(limit_file).read().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
        break
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return total // max(per_node, 1)


def wrap(model: nn.Module, choice: Choice, dims: ParallelDims) -> nn.Module:
    """``model`` as ``choice`` holds it: sharded by ``fsdp.shard_model``, replicated by ``replicate``, or as it is."""
    if choice.sharded:
        from automodel_ckpt.distributed.fsdp import shard_model

        return shard_model(model, dims, choice.mixed_precision)
    if choice.kind == REPLICATED:  # in a bucket layout every launch reduces alike (``grad_buckets``)
        from automodel_ckpt.distributed.grad_buckets import replicate_model

        return replicate_model(model)
    return model


def build_reducer(model: nn.Module, choice: Choice) -> None:
    """A replicated model's reducer built now, not at its first forward (which may train nothing: a reference)."""
    if choice.kind != REPLICATED:
        return
    from torch.distributed._composable.replicate import replicate

    state = replicate.state(model)
    if state is not None and state._init_args is not None and (state._init_args or state._init_kwargs):
        state.lazy_init()


def sync_gradients(model: nn.Module, sync: bool) -> None:
    """Whether the next backward exchanges gradients (off for all but the last micro-batch of a step)."""
    if hasattr(model, "set_requires_all_reduce"):  # FSDP2: reduce-scatter always, HSDP's all-reduce on the last
        model.set_requires_all_reduce(sync)
    elif hasattr(model, "set_requires_gradient_sync"):  # replicated: no all-reduce until the last
        model.set_requires_gradient_sync(sync)


def _mp_dtype(name: str | None) -> Any:
    if name is None:
        return None
    from automodel_ckpt.distributed.fsdp import mixed_precision_policy

    policy = mixed_precision_policy(name)
    return policy.param_dtype if policy is not None else None
