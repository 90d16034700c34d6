"""Reading a Hugging Face model folder (or an archive of one) into a sharded model: each rank reads its own slices.

DCP plans the reads from each parameter's placements and the safetensors reader reads just the rank's byte ranges;
on-disk names map to the model's through the export's ``disk_layout``, reversed. A part of a fused tensor (an
expert of a stack) that is a box of it is read only by the ranks whose slice it meets; one that is not, whole.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from automodel_ckpt.distributed import collective
from automodel_ckpt.export import ArchiveHFReader, is_archive
from automodel_ckpt.ondisk.formats.family import DiskTensor, auto_model_class, c_strides, disk_layout
from automodel_ckpt.ondisk.fastio.common import BYTES_READ, scratch
from automodel_ckpt.ondisk.fastio.readers import ParallelHFReader
from automodel_ckpt.errors import CheckpointError

logger = logging.getLogger(__name__)


def in_memory_names(model: Any) -> tuple[Any, dict[str, str]]:
    """``(transformers model, {in-memory name: state-dict key})``; a PEFT model's base, adapters left out."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    adapters = _adapter_keys(base)
    return base, {key.replace(".base_layer.", "."): key for key in base.state_dict() if key not in adapters}


def _adapter_keys(base: Any) -> set[str]:
    out = set()
    for mod_name, module in base.named_modules():
        for attr in getattr(module, "adapter_layer_names", ()) + getattr(module, "other_param_names", ()):
            holder = getattr(module, attr, None)
            if isinstance(holder, torch.nn.Module):
                prefix = f"{mod_name}.{attr}." if mod_name else f"{attr}."
                out.update(prefix + k for k in holder.state_dict())
    return out


def local_part(full: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The part of ``full`` (a whole tensor) that ``target`` (a ``DTensor`` or a plain tensor) holds on this rank."""
    start, size = _region(target)
    return full[tuple(slice(o, o + n) for o, n in zip(start, size))]


def _local(target: torch.Tensor) -> torch.Tensor:
    return target.to_local() if hasattr(target, "to_local") else target


def load_hf_weights(model: Any, folder: Path, *, buffers_optional: bool = True) -> int:
    """Collective: HF folder (or archive) ``folder``'s weights into ``model``; this rank's bytes read. Every
    parameter must be there (or tied to one that is); a buffer that is not (rotary tables) is left as it is."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    folder = Path(folder)
    before = BYTES_READ.total
    base, names = in_memory_names(model)
    state = base.state_dict(keep_vars=True)  # the tensors themselves: tied weights are one object
    buffer_keys = {k for k, _ in base.named_buffers()}
    reader = _reader(folder)
    on_disk = reader.read_metadata().state_dict_metadata
    mem = {name: state[key] for name, key in names.items()}
    layout = disk_layout(base.config.to_dict(), {n: (tuple(t.shape), t.dtype) for n, t in mem.items()},
                         base_names=list(on_disk))
    if layout is None:  # an unknown family: the folder keeps the in-memory names
        layout = {n: DiskTensor(n, n, tuple(t.shape), 0, c_strides(tuple(t.shape))) for n, t in mem.items()}
    whole: dict[str, torch.Tensor] = {}
    parts: dict[str, list[DiskTensor]] = {}
    for disk_name, view in layout.items():
        if disk_name not in on_disk:
            if names[view.source] in buffer_keys and buffers_optional:
                continue
            raise CheckpointError(f"'{folder}' does not fit the model: tensor '{disk_name}' is not in its safetensors "
                                  "files; point model.pretrained_model_name_or_path at this model's own folder")
        if view.is_whole(tuple(mem[view.source].shape)):
            whole[disk_name] = mem[view.source]
        else:
            parts.setdefault(view.source, []).append(view)
    covered = {v.source for v in layout.values() if v.name in on_disk}
    covered_ids = {id(mem[n]) for n in covered}  # a tied weight is filled through the one it is tied to
    missing = sorted(n for n in mem if n not in covered and id(mem[n]) not in covered_ids
                     and names[n] not in buffer_keys)
    if missing:
        raise CheckpointError(f"'{folder}' does not fit the model: {len(missing)} tensor(s) missing (e.g. "
                              f"'{missing[0]}'); point model.pretrained_model_name_or_path at this model's own folder")
    boxed = []  # (part, where it lies, its tensor, the region of that tensor this rank holds)
    for source in list(parts):
        boxes = [_box(v, tuple(mem[source].shape)) for v in parts[source]]
        if all(b is not None for b in boxes):
            region = _region(mem[source])
            boxed += [(v, b, mem[source], region) for v, b in zip(parts.pop(source), boxes) if b.meets(region)]
    pieces = {v.name: scratch(tuple(on_disk[v.name].size), on_disk[v.name].properties.dtype)
              for v in [*(v for views in parts.values() for v in views), *(v for v, *_ in boxed)]}
    if parts:
        logger.info("%d tensor(s) of '%s' are read whole on every rank (the family stores them in parts): %s",
                    len(parts), folder, ", ".join(sorted(parts)))
    with torch.no_grad():
        dcp.load({**whole, **pieces}, storage_reader=reader, planner=DefaultLoadPlanner())
        for view, box, target, region in boxed:
            box.copy_into(_local(target), region, pieces.pop(view.name))
        for source, views in parts.items():
            target = mem[source]
            full = scratch(tuple(target.shape), pieces[views[0].name].dtype)
            flat = full.view(-1)
            for v in views:
                flat.as_strided(v.shape, v.stride, v.offset).copy_(pieces.pop(v.name))
            _local(target).copy_(local_part(full, target))
            del full
    return BYTES_READ.total - before


def load_hf_folder(model: Any, folder: Path, rank: int) -> None:
    """Collective: HF folder (or archive) ``folder`` into ``model``; ``.bin`` files only: rank 0 reads, broadcast."""
    if not is_archive(folder) and not any(Path(folder).glob("*.safetensors")):  # PyTorch .bin weights only
        _load_on_rank0(model, folder, rank)
    else:
        collective.collectively(lambda: load_hf_weights(model, folder), f"reading '{folder}'", rank)


def _load_on_rank0(model: Any, folder: Path, rank: int) -> None:
    """Collective: transformers reads ``folder`` on rank 0, torch broadcasts it into every rank's shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    def read() -> dict[str, torch.Tensor]:
        dtype = next(model.parameters()).dtype
        loaded = auto_model_class(folder).from_pretrained(folder, dtype=dtype)
        wanted = set(model.state_dict())
        state = {k: v for k, v in loaded.state_dict().items() if k in wanted}
        missing = sorted(wanted - set(state))
        if missing:
            raise CheckpointError(f"'{folder}' does not fit the model: {len(missing)} tensor(s) missing "
                                  f"(e.g. '{missing[0]}')")
        return state

    full: dict[str, torch.Tensor] = {}
    collective.on_main(lambda: full.update(read()), f"reading '{folder}'", rank)  # a failure reaches every rank
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def _reader(folder: Path) -> ParallelHFReader:
    """The storage reader of ``folder``: the pages of this rank's pieces, nothing between them."""
    if is_archive(folder):
        return ArchiveHFReader(folder, gap=0)
    return ParallelHFReader(folder, gap=0)


def _region(target: torch.Tensor) -> tuple[list[int], list[int]]:
    """``(start, size)`` per dimension of the part of ``target``'s whole tensor that this rank holds."""
    from torch.distributed.tensor import DTensor

    if not isinstance(target, DTensor):
        return [0] * target.dim(), list(target.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
    return list(offset), list(shape)


class _Box:
    """Where an on-disk part lies in its in-memory tensor when it is a box of it; ``dims``: the axes it runs along."""

    def __init__(self, start: list[int], size: list[int], dims: list[int | None]):
        self.start, self.size, self.dims = start, size, dims

    def overlap(self, region: tuple[list[int], list[int]]) -> list[slice] | None:
        out = []
        for s, n, (o, m) in zip(self.start, self.size, zip(*region)):
            lo, hi = max(s, o), min(s + n, o + m)
            if hi <= lo:
                return None
            out.append(slice(lo, hi))
        return out

    def meets(self, region: tuple[list[int], list[int]]) -> bool:
        return self.overlap(region) is not None

    def copy_into(self, local: torch.Tensor, region: tuple[list[int], list[int]], piece: torch.Tensor) -> None:
        """Copy the overlap of ``piece`` (the part, as read) and ``region`` into ``local`` (the rank's slice)."""
        runs = [d for d in self.dims if d is not None]
        order = sorted(range(len(runs)), key=runs.__getitem__)
        placed = piece.reshape([n for n, d in zip(piece.shape, self.dims) if d is not None]).permute(order)
        placed = placed.reshape(self.size)
        overlap = self.overlap(region)
        assert overlap is not None
        src = tuple(slice(sl.start - s, sl.stop - s) for sl, s in zip(overlap, self.start))
        dst = tuple(slice(sl.start - o, sl.stop - o) for sl, o in zip(overlap, region[0]))
        local[dst].copy_(placed[src])


def _box(view: DiskTensor, shape: tuple[int, ...]) -> _Box | None:
    """The box ``view`` fills in a tensor of ``shape``, or None when its elements are not one box of it."""
    strides = c_strides(tuple(shape))
    start, rest = [], view.offset
    for stride in strides:
        start.append(rest // stride)
        rest %= stride
    size, dims = [1] * len(shape), []
    for n, stride in zip(view.shape, view.stride):
        if n == 1:
            dims.append(None)
            continue
        match = [d for d, s in enumerate(strides) if s == stride and shape[d] > 1 and size[d] == 1]
        if len(match) != 1 or start[match[0]] + n > shape[match[0]]:
            return None
        size[match[0]] = n
        dims.append(match[0])
    if any(s >= n for s, n in zip(start, shape)):
        return None
    return _Box(start, size, dims)

