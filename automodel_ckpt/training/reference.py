"""A preference run's reference: its fingerprints, its sync from the policy, and its stored log-probs file."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from automodel_ckpt.ondisk import layout


def weights_fingerprint(model: nn.Module) -> str:
    """A SHA-256 of every parameter's whole value (name, dtype, shape, bytes), the same at any world size and
    mesh: each sharded parameter is gathered whole, one at a time (collective on every rank)."""
    h = hashlib.sha256()
    for name, param in model.named_parameters():
        whole = param.full_tensor() if hasattr(param, "full_tensor") else param
        whole = whole.detach().cpu().contiguous()
        h.update(json.dumps([_plain_name(name), str(whole.dtype), list(whole.shape)]).encode())
        h.update(whole.view(torch.uint8).numpy().tobytes() if whole.numel() else b"")
    return h.hexdigest()[:24]


def _plain_name(name: str) -> str:
    """The parameter's name without wrappers' prefixes (``torch.compile``'s ``_orig_mod.``)."""
    return name.replace("_orig_mod.", "")


def reference_identity(model_section: Mapping[str, Any], base_folder: str | None, *, adapters_disabled: bool) -> str:
    """What the reference is, without reading its weights: the ``model:`` section, the base folder's config and
    the names and sizes of its weight files, and whether it is a LoRA model with its adapters disabled."""
    files: list[Any] = []
    if base_folder is not None and Path(base_folder).is_dir():
        folder = Path(base_folder)
        config = folder / layout.HF_CONFIG
        files.append(config.read_text() if config.is_file() else None)
        files += sorted((f.name, f.stat().st_size) for f in folder.glob("*.safetensors"))
    payload = json.dumps([dict(model_section), files, adapters_disabled], sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


@torch.no_grad()
def mix_into(reference: nn.Module, policy: nn.Module, alpha: float) -> None:
    """TR-DPO's soft update, in place on each rank's shards: ``reference <- alpha * policy + (1 - alpha) *
    reference``. Parameters laid out alike are mixed shard by shard; where the layouts differ (a frozen reference
    that FSDP2 left on the tensor-parallel mesh alone) the policy's parameter is gathered whole, one at a time,
    and each rank mixes in its own part."""
    from automodel_ckpt.checkpoint import local_part

    ref_params = {_plain_name(n): p for n, p in reference.named_parameters()}
    for name, param in policy.named_parameters():
        ref = ref_params.get(_plain_name(name))
        if ref is None or ref.shape != param.shape:
            raise ValueError(f"the reference has no parameter '{name}' shaped like the policy's")
        if _layout(ref) == _layout(param):
            ref.mul_(1 - alpha).add_(param.detach().to(ref.dtype), alpha=alpha)
            continue
        whole = param.full_tensor() if hasattr(param, "full_tensor") else param
        local = ref.to_local() if hasattr(ref, "to_local") else ref
        local.mul_(1 - alpha).add_(local_part(whole.detach().to(local.dtype), ref), alpha=alpha)


def _layout(tensor: torch.Tensor) -> Any:
    """A parameter's mesh and placements (None for a plain tensor)."""
    mesh = getattr(tensor, "device_mesh", None)
    return None if mesh is None else (mesh, tuple(tensor.placements))


class StoredLogProbs:
    """Precomputed reference log-probs of a run's pairs: ``{split: float64 tensor [2, pairs]}`` (summed log-probs
    of the chosen and the rejected response of each pair row), in one file named by ``key`` (data and reference)."""

    def __init__(self, key: str, tables: dict[str, torch.Tensor]) -> None:
        self.key, self.tables = key, tables

    def lookup(self, split: str, pair_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The chosen and rejected reference log-probs of ``pair_rows`` (a filler row, -1, gets zeros)."""
        table = self.tables[split]
        got = table[:, pair_rows.clamp(min=0)]
        got[:, pair_rows < 0] = 0
        return got[0], got[1]

    def save(self, file: Path) -> None:
        """Written under a temporary name and moved into place: a reader never sees half a file."""
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_name(f".{file.name}.tmp-{os.getpid()}")
        torch.save({"key": self.key, "tables": self.tables}, tmp)
        os.replace(tmp, file)

    @classmethod
    def load(cls, file: Path, key: str) -> "StoredLogProbs | None":
        """The stored log-probs of ``key``, or None when the file is absent (or holds another key)."""
        if not file.is_file():
            return None
        saved = torch.load(file, map_location="cpu", weights_only=True)
        if saved.get("key") != key:
            return None
        return cls(key, {k: v.to(torch.float64) for k, v in saved["tables"].items()})
