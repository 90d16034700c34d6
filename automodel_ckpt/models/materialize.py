"""A model built on the meta device gets its first weights once sharded: each rank materialises only its own part.

Built on meta, wrapped by LoRA (``kept_parameters`` keeps the adapters PEFT draws from the seeded RNG), sharded,
then ``materialize`` gives each rank storage for its own shards and computes the buffers no weight file holds;
``fill`` then reads the base folder's slices, or (a ``config``-built model) rank 0 builds it from the seed and
broadcasts it, unless a restored checkpoint filled it. A custom ``model._target_`` is built whole; nothing here applies.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

#: The builders that can build on the meta device (``on_meta=True``).
META_BUILDERS = frozenset({"automodel_ckpt.models.build.build_causal_lm",
                           "automodel_ckpt.models.build.build_image_text_model"})
#: A folder where every rank writes what its materialisation held and read (``rank<R>.json``), for tests.
RECORD_ENV = "AUTOMODEL_CKPT_LOAD_RECORD"


def builds_on_meta(node: Mapping[str, Any]) -> bool:
    """Whether the ``model:`` section names one of this package's builders (which build on the meta device)."""
    return str(node.get("_target_", "")) in META_BUILDERS


class StartingWeights:
    """Where a meta-built model's first weights come from, filled on every rank (``build_whole``: a one-rank build)."""

    def __init__(self, node: Mapping[str, Any], rank: int, build_whole: Callable[[], nn.Module]) -> None:
        self.node = dict(node)
        self.rank = rank
        self._build_whole = build_whole
        self.on_meta = builds_on_meta(self.node)
        self._created: list[tuple[nn.Module, str, torch.Tensor]] = []
        self._record: dict[str, Any] = {}

    @property
    def record(self) -> dict[str, Any]:
        """What this rank's materialisation held and read (``base_bytes_read``, ``params``; see ``RECORD_ENV``)."""
        return self._record

    # ------------------------------------------------------------------------------------ before sharding
    @contextmanager
    def kept_parameters(self) -> Iterator[None]:
        """Parameters created with storage inside the block (LoRA adapters) keep their values, for ``fill``."""
        if not self.on_meta:
            yield
            return
        created = []

        def hook(module: nn.Module, name: str, param: Any) -> None:
            if param is not None and param.device.type != "meta":
                created.append((module, name, param))

        handle = nn.modules.module.register_module_parameter_registration_hook(hook)
        try:
            yield
        finally:
            handle.remove()
        # only those the module still holds (a module may replace a parameter while it is built)
        self._created += [(m, n, p.detach().clone()) for m, n, p in created if n in m._parameters]

    # ------------------------------------------------------------------------------------- after sharding
    def materialize(self, model: nn.Module, device: torch.device) -> None:
        """Storage for this rank's shards on ``device``; buffers that no weight file holds computed; ties kept."""
        if not self.on_meta:
            return
        materialize_module(model, device)
        self._record["params"] = _held(model)

    def fill(self, model: nn.Module, *, model_loaded: bool) -> None:
        """Collective: the first weights of whatever the restore did not fill (a PEFT model's restore: its adapters)."""
        if not self.on_meta:
            return
        peft = hasattr(model, "get_base_model")
        if not model_loaded:
            self._fill_created()
        if peft or not model_loaded:
            if self.node.get("config") is not None:
                self._broadcast_seeded(model)
            else:
                self._read_folder(model)
        self._created.clear()
        self._write_record()

    def _fill_created(self) -> None:
        from automodel_ckpt.checkpoint import local_part

        with torch.no_grad():
            for module, name, full in self._created:
                target = getattr(module, name)
                local = target.to_local() if hasattr(target, "to_local") else target
                local.copy_(local_part(full.to(local.dtype), target))

    def _read_folder(self, model: nn.Module) -> None:
        from automodel_ckpt.checkpoint import load_hf_weights
        from automodel_ckpt.models.hub import model_folder

        folder = model_folder(str(self.node.get("pretrained_model_name_or_path")))  # built from it: it is there
        self._record["base_bytes_read"] = load_hf_weights(model, folder)
        self._record["base_file_bytes"] = sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))

    def _broadcast_seeded(self, model: nn.Module) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        from automodel_ckpt.checkpoint import in_memory_names
        from automodel_ckpt.training.rng import rng_untouched

        base, names = in_memory_names(model)
        full: dict[str, torch.Tensor] = {}
        if self.rank == 0:  # the model as a one-rank run builds it: the same seed, the same values
            with rng_untouched():
                whole = self._build_whole().state_dict()
            # every tensor of the whole model: a pipeline stage's ranks take those they hold
            full = {names.get(name, name): tensor for name, tensor in whole.items()}
        set_model_state_dict(base, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                                                  strict=False))

    def _write_record(self) -> None:
        folder = os.environ.get(RECORD_ENV)
        if not folder:
            return
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"rank{self.rank}.json").write_text(json.dumps(self._record, indent=1) + "\n")


def materialize_module(model: nn.Module, device: torch.device | str) -> None:
    """``to_empty`` on ``device`` (this rank's shards, values undefined), tied weights tied again, buffers computed."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    by_id: dict[int, list[str]] = {}  # a tied weight: one parameter under several names
    for name, param in base.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    model.to_empty(device=device)
    for group in (names for names in by_id.values() if len(names) > 1):
        first = base.get_parameter(group[0])
        for name in group[1:]:
            if base.get_parameter(name) is not first:
                owner, _, attr = name.rpartition(".")
                setattr(base.get_submodule(owner), attr, first)
    init_buffers(base)


def init_buffers(base: nn.Module) -> None:
    """A materialised transformers model's buffers (rotary tables) computed by its own init, parameters untouched."""
    from transformers import PreTrainedModel

    if not isinstance(base, PreTrainedModel):
        return
    for module in base.modules():
        module.__dict__.pop("_is_hf_initialized", None)
    flagged = []
    for param in base.parameters():
        if not getattr(param, "_is_hf_initialized", False):
            param._is_hf_initialized = True
            flagged.append(param)
    base.initialize_weights()
    for param in flagged:
        del param._is_hf_initialized


def _held(model: nn.Module) -> list[dict[str, Any]]:
    """Each parameter's global and local element counts, and whether it is sharded (for the load record)."""
    from torch.distributed.tensor import DTensor, Shard

    out = []
    for name, p in model.named_parameters():
        sharded = isinstance(p, DTensor) and any(isinstance(pl, Shard) and p.device_mesh.size(i) > 1
                                                 for i, pl in enumerate(p.placements))
        local = p.to_local() if isinstance(p, DTensor) else p
        out.append({"name": name, "numel": p.numel(), "local": local.numel(), "sharded": sharded})
    return out
