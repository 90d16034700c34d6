"""A preference run's reference: its fingerprints, its sync from the policy, and its stored log-probs file."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from automodel_ckpt.errors import CheckpointError, first_line
from automodel_ckpt.ondisk import HFFolder, load_pt


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
    """What the reference is, without reading its weights: its section, config, weight files, LoRA disabled."""
    files: list[Any] = []
    if base_folder is not None and Path(base_folder).is_dir():
        folder = Path(base_folder)
        config = HFFolder(folder).config
        files.append(config.read_text() if config.is_file() else None)
        files += sorted((f.name, f.stat().st_size) for f in folder.glob("*.safetensors"))
    payload = json.dumps([dict(model_section), files, adapters_disabled], sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


@torch.no_grad()
def mix_into(reference: nn.Module, policy: nn.Module, alpha: float) -> None:
    """TR-DPO's soft update on each rank's shards, ``reference <- alpha * policy + (1 - alpha) * reference``;
    where the layouts differ the policy's parameter is gathered whole, one at a time."""
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
    """Precomputed reference log-probs of a run's pairs, ``{split: float64 [2, pairs]}`` (chosen, rejected), in one
    file named by ``key``. Untrusted: a regular file inside the run folder (no link), bounded, loaded safely, each
    table ``[2, pairs]`` of finite numbers for exactly the run's pairs; else one line naming the file."""

    def __init__(self, key: str, tables: dict[str, torch.Tensor]) -> None:
        self.key, self.tables = key, tables

    def lookup(self, split: str, pair_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The chosen and rejected reference log-probs of ``pair_rows`` (a filler row, -1, gets zeros)."""
        table = self.tables[split]
        got = table[:, pair_rows.clamp(min=0)]
        got[:, pair_rows < 0] = 0
        return got[0], got[1]

    def save(self, file: Path, root: Path) -> None:
        """Written under a temporary name and moved into place, never through a folder outside the run folder."""
        _inside(Path(root), Path(file))
        file.parent.mkdir(parents=True, exist_ok=True)
        _inside(Path(root), Path(file))  # the folder just made (or found) is still the run folder's own
        tmp = file.with_name(f".{file.name}.tmp-{os.getpid()}")
        torch.save({"key": self.key, "tables": self.tables}, tmp)
        os.replace(tmp, file)

    @classmethod
    def load(cls, file: Path, key: str, *, root: Path, pairs: Mapping[str, int]) -> "StoredLogProbs | None":
        """``key``'s stored log-probs for ``pairs`` (None: absent or another key's); ``CheckpointError`` naming it."""
        file = Path(file)
        _inside(Path(root), file)
        if not os.path.lexists(file):
            return None
        if os.path.islink(file):
            raise _bad(file, "is a link; they are read only as a regular file of the run folder")
        limit = sum(16 * max(int(n), 0) for n in pairs.values()) + _SLACK_BYTES
        size = os.stat(file).st_size
        if size > limit:
            raise _bad(file, f"are {size} bytes, more than {limit} for {sum(pairs.values())} pairs")
        try:
            saved = load_pt(file)  # regular files only (never through a link, never a FIFO); no code runs
        except CheckpointError as exc:
            raise _bad(file, f"cannot be read ({first_line(exc).split(': ', 1)[-1]})") from None
        if not isinstance(saved, dict) or not isinstance(saved.get("key"), str) or \
                not isinstance(saved.get("tables"), dict):
            raise _bad(file, f"are not a table file (it holds a {type(saved).__name__})")
        if saved["key"] != key:
            return None
        tables = {}
        for split, n in pairs.items():
            table = saved["tables"].get(split)
            if not isinstance(table, torch.Tensor) or not table.is_floating_point():
                raise _bad(file, f"hold no '{split}' table of numbers (found {_what(table)})")
            if tuple(table.shape) != (2, n):
                raise _bad(file, f"hold a '{split}' table of shape {list(table.shape)}, this run has {n} pairs "
                                 f"(expected [2, {n}])")
            table = table.to(torch.float64)
            bad = (~torch.isfinite(table)).nonzero()
            if len(bad):
                raise _bad(file, f"hold a value that is not finite ({table[tuple(bad[0])].item()}) for '{split}' "
                                 f"pair {int(bad[0][1])}")
            tables[split] = table
        return cls(key, tables)


#: What a stored log-probs file may hold beyond its tables' 16 bytes a pair (the archive's records and names).
_SLACK_BYTES = 2**20


def _bad(file: Path, what: str) -> CheckpointError:
    return CheckpointError(f"'{file}': the stored reference log-probs {what}; delete the file to compute them again")


def _what(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor"
    return "nothing" if value is None else f"a {type(value).__name__}"


def _inside(root: Path, file: Path) -> None:
    """``CheckpointError`` unless ``file``'s folder, links resolved, is inside the run folder ``root``."""
    top = os.path.realpath(root)
    where = os.path.realpath(file.parent)
    if where != top and not where.startswith(top.rstrip(os.sep) + os.sep):
        raise _bad(file, f"lie outside the run folder '{root}' (a link leads to '{where}'); they are read and "
                         "written only inside it")
