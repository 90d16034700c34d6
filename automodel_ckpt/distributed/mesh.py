"""Who is who on the device mesh: the data-parallel (replicate × shard) and tensor-parallel sizes, ranks and groups.

Computed once from the ``distributed:`` keys and the world size, then passed down: the data loader, validation,
the per-rank checkpoint files and the loss reductions ask this object for the data-parallel rank and size, never
the global rank. Ranks are laid out with tensor parallelism innermost (``global rank = dp rank × tp + tp rank``),
so the tensor-parallel peers of a data-parallel rank sit next to each other (on one node, where the links are
fastest), and a data-parallel rank is ``replicate × dp_shard + shard``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from automodel_ckpt.errors import ConfigError

#: Keys recognised in ``distributed:`` whose strategies are not implemented: refused unless 1 or null.
UNSUPPORTED = {"pp_size": "pipeline parallelism", "cp_size": "context parallelism", "ep_size": "expert parallelism"}
#: Tensor parallelism does not split an image-text model yet: refused before launch for the package's image-text
#: builder (``config/validate.py``) and, for any other, when the model is sharded (``fsdp.shard_model``).
IMAGE_TEXT_TP_REFUSAL = ("distributed.tp_size: tensor parallelism for image-text models is not supported yet; "
                         "use tp_size 1")


@dataclass(frozen=True)
class MeshSizes:
    """The sizes of the mesh: ``dp_replicate × dp_shard`` data-parallel ranks, each ``tp`` tensor-parallel ranks."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    sequence_parallel: bool = False

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.dp * self.tp

    @property
    def one_dimensional(self) -> bool:
        """Plain FSDP2 over every rank (the default)."""
        return self.tp == 1 and self.dp_replicate == 1

    def describe(self) -> str:
        """``dp 4``, ``dp 2 × tp 2``, ``tp 2``, ``HSDP 2 × 2``, ``HSDP 2 × 2 × tp 2``; ``... + SP`` with sequence
        parallelism (which a checkpoint does not record: its tensors are the same)."""
        parts = []
        if self.dp_replicate > 1:
            parts.append(f"HSDP {self.dp_replicate} × {self.dp_shard}")
        elif self.dp_shard > 1 or self.tp == 1:
            parts.append(f"dp {self.dp_shard}")
        if self.tp > 1:
            parts.append(f"tp {self.tp}")
        return " × ".join(parts) + (" + SP" if self.sequence_parallel else "")

    def record(self) -> dict[str, int]:
        """What a checkpoint's metadata records (``mesh``)."""
        return {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "tp": self.tp}

    @classmethod
    def from_record(cls, record: Any, world_size: int) -> MeshSizes:
        """The sizes a checkpoint recorded; a checkpoint without a record was written on a 1-D mesh."""
        if isinstance(record, dict):
            try:
                return cls(int(record.get("dp_replicate", 1)), int(record.get("dp_shard", 1)), int(record.get("tp", 1)))
            except (TypeError, ValueError):
                pass
        return cls(1, max(int(world_size), 1), 1)


def resolve_sizes(section: Any, world_size: int) -> MeshSizes:
    """The mesh the ``distributed:`` section asks for on ``world_size`` ranks; one-line ``ConfigError`` otherwise."""
    get = section.get if hasattr(section, "get") else lambda key, default=None: getattr(section, key, default)
    for key, what in UNSUPPORTED.items():
        value = get(key, None)
        if value not in (None, 1):
            raise ConfigError(f"distributed.{key}: {what} is not supported yet; leave it at 1 (or null)")
    tp = _size(get("tp_size", 1), "tp_size", 1)
    replicate = _size(get("dp_replicate_size", 1), "dp_replicate_size", 1)
    dp = get("dp_size", None)
    if dp is None:
        if world_size % tp:
            raise ConfigError(f"distributed.tp_size ({tp}) does not divide the world size ({world_size}); start a "
                              f"multiple of {tp} processes or change distributed.tp_size")
        dp = world_size // tp
    dp = _size(dp, "dp_size", None)
    if dp * tp != world_size:
        raise ConfigError(f"distributed: dp_size × tp_size = {dp} × {tp} = {dp * tp} must equal the world size "
                          f"({world_size}); change the sizes (dp_size: null takes what tp_size leaves)")
    if dp % replicate:
        raise ConfigError(f"distributed.dp_replicate_size ({replicate}) must divide dp_size ({dp}): HSDP shards "
                          "within each of dp_replicate_size groups of dp_size / dp_replicate_size ranks")
    sequence_parallel = bool(get("sequence_parallel", False))
    if sequence_parallel and tp == 1:
        raise ConfigError("distributed.sequence_parallel: true needs tensor parallelism (it splits the activations "
                          "over the tensor-parallel ranks); set distributed.tp_size > 1 or sequence_parallel false")
    return MeshSizes(replicate, dp // replicate, tp, sequence_parallel)


def _size(value: Any, key: str, default: int | None) -> int:
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"distributed.{key}: expected a positive integer, got {value!r}")
    return value


@dataclass
class ParallelDims:
    """This rank's place on the mesh, and the meshes and groups each job uses.

    ``fsdp_mesh``: what ``fully_shard`` shards (and, with HSDP, replicates) over; ``tp_mesh``: what tensor
    parallelism splits over (None without it); ``dp_group``: the group that sums losses and token counts (None: every
    rank, as without tensor parallelism).
    """

    sizes: MeshSizes
    rank: int
    mesh: Any = None
    fsdp_mesh: Any = None
    tp_mesh: Any = None
    dp_group: Any = None

    @property
    def tp_rank(self) -> int:
        return self.rank % self.sizes.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.sizes.tp

    @property
    def dp_size(self) -> int:
        return self.sizes.dp

    @property
    def tp_size(self) -> int:
        return self.sizes.tp

    @property
    def replicate_rank(self) -> int:
        return self.dp_rank // self.sizes.dp_shard

    @property
    def shard_rank(self) -> int:
        return self.dp_rank % self.sizes.dp_shard

    @property
    def writes_rank_state(self) -> bool:
        """Whether this rank writes its data-parallel rank's small files (the data position, RNG): the first of
        its tensor-parallel peers, which hold the same."""
        return self.tp_rank == 0

    def sum_over_dp(self, value: Any) -> Any:
        """``value`` summed over the data-parallel ranks (float64 on the CPU): each tensor-parallel peer gets the
        same total, which counts every data-parallel rank's value once."""
        from automodel_ckpt.distributed.env import all_reduce_sum

        return all_reduce_sum(value, group=self.dp_group)

    @classmethod
    def single(cls, rank: int = 0, world_size: int = 1) -> ParallelDims:
        """A 1-D data-parallel layout without meshes (what a caller that builds no mesh gets)."""
        return cls(MeshSizes(1, world_size, 1), rank)


def build_parallel_dims(sizes: MeshSizes, rank: int, device_type: str) -> ParallelDims:
    """Create the device mesh of ``sizes`` (collective: every rank calls it, in the same order).

    The default (1-D) layout is the mesh FSDP2 has always used, ``("dp",)``; otherwise the dimensions larger than
    one, named ``dp_replicate``, ``dp_shard`` and ``tp`` (``dp_shard`` always: ``fully_shard`` then has a mesh to
    work on, of one rank under tensor parallelism alone).
    """
    from torch.distributed.device_mesh import init_device_mesh

    if sizes.one_dimensional:
        mesh = init_device_mesh(device_type, (sizes.world_size,), mesh_dim_names=("dp",))
        return ParallelDims(sizes, rank, mesh, fsdp_mesh=mesh)
    dims = [("dp_shard", sizes.dp_shard)] + [("tp", sizes.tp)] * (sizes.tp > 1)  # dp_shard even of size 1
    if sizes.dp_replicate > 1:
        dims.insert(0, ("dp_replicate", sizes.dp_replicate))
    names = tuple(n for n, _ in dims)
    mesh = init_device_mesh(device_type, tuple(s for _, s in dims), mesh_dim_names=names)
    dp_names = tuple(n for n in names if n != "tp")
    fsdp_mesh = mesh[dp_names]
    tp_mesh = mesh["tp"] if sizes.tp > 1 else None
    dp_group = None  # without tensor parallelism the data-parallel ranks are every rank
    if sizes.tp > 1:  # the losses of tensor-parallel peers are the same: sum over the data-parallel ranks only
        dp_group = (mesh[dp_names]._flatten("dp") if len(dp_names) == 2 else mesh[dp_names[0]]).get_group()
    return ParallelDims(sizes, rank, mesh, fsdp_mesh=fsdp_mesh, tp_mesh=tp_mesh, dp_group=dp_group)
