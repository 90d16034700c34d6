"""Who is who on the device mesh: the pipeline, data-parallel (replicate × shard), tensor- and expert-parallel sizes.

The data, the per-rank files and the losses use its data-parallel rank; the layout: docs/parallelism.md.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

from omegaconf import ListConfig

from automodel_ckpt.errors import ConfigError

#: Keys recognised in ``distributed:`` whose strategies are not implemented: refused unless 1 or null.
UNSUPPORTED = {"cp_size": "context parallelism"}
#: The pipeline schedules ``distributed.pp_schedule`` accepts (torch's schedules of these names).
PP_SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b")
#: Refused before launch (``config/validate.py``) or when the model is sharded (``fsdp.shard_model``).
IMAGE_TEXT_TP_REFUSAL = ("distributed.tp_size: tensor parallelism for image-text models is not supported yet; "
                         "use tp_size 1")
#: The ``distributed:`` keys the mesh sizes depend on.
_KEYS = (*UNSUPPORTED, "tp_size", "pp_size", "sequence_parallel", "dp_replicate_size", "dp_size", "pp_layers",
         "pp_microbatches", "ep_size")
IMAGE_TEXT_EP_REFUSAL = ("distributed.ep_size: expert parallelism for image-text models is not supported yet; "
                         "use ep_size 1")


@dataclass(frozen=True)
class MeshSizes:
    """The sizes of the mesh: ``pp`` stages × ``dp_replicate`` × ``dp_shard`` × ``tp``; experts over ``ep`` ranks."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    sequence_parallel: bool = False
    pp: int = 1
    ep: int = 1

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def one_dimensional(self) -> bool:
        """Plain FSDP2 over every rank (the default)."""
        return self.tp == 1 and self.dp_replicate == 1 and self.pp == 1 and self.ep == 1

    def describe(self) -> str:
        """``dp 4``, ``HSDP 2 × 2 × tp 2``, ``dp 2 × pp 2``, ``dp 2 × ep 2``, ``... + SP``."""
        parts = []
        if self.dp_replicate > 1:
            parts.append(f"HSDP {self.dp_replicate} × {self.dp_shard}")
        elif self.dp_shard > 1 or (self.tp == 1 and self.pp == 1):
            parts.append(f"dp {self.dp_shard}")
        parts += [f"{name} {size}" for name, size in (("pp", self.pp), ("tp", self.tp), ("ep", self.ep)) if size > 1]
        return " × ".join(parts) + (" + SP" if self.sequence_parallel else "")

    def record(self) -> dict[str, int]:
        """What a checkpoint's metadata records (``mesh``; ``pp`` and ``ep`` only when above 1)."""
        return {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "tp": self.tp} | (
            {"pp": self.pp} if self.pp > 1 else {}) | ({"ep": self.ep} if self.ep > 1 else {})

    @classmethod
    def from_record(cls, record: Any, world_size: int) -> MeshSizes:
        """The sizes a checkpoint recorded (missing ``pp``, ``ep``: 1); without a record, a 1-D mesh."""
        if isinstance(record, dict):
            with contextlib.suppress(TypeError, ValueError):
                return cls(int(record.get("dp_replicate", 1)), int(record.get("dp_shard", 1)), int(record.get("tp", 1)),
                           pp=int(record.get("pp", 1)), ep=int(record.get("ep", 1)))
        return cls(1, max(int(world_size), 1), 1)


def resolve_sizes(section: Any, world_size: int) -> MeshSizes:
    """The mesh ``distributed:`` asks for on ``world_size`` ranks (cached); one-line ``ConfigError`` otherwise."""
    get = section.get if hasattr(section, "get") else lambda key, default=None: getattr(section, key, default)
    values = tuple((key, type(v), tuple(v) if isinstance(v, (list, ListConfig)) else v)
                   for key, v in ((key, get(key, None)) for key in _KEYS))  # the type too: True == 1, and is no size
    return _resolve(values, world_size)


@functools.lru_cache(maxsize=16)
def _resolve(values: tuple[tuple[str, type, Any], ...], world_size: int) -> MeshSizes:
    get = {key: value for key, _, value in values}.get
    for key, what in UNSUPPORTED.items():
        value = get(key, None)
        if value not in (None, 1):
            raise ConfigError(f"distributed.{key}: {what} is not supported yet; leave it at 1 (or null)")
    tp = _size(get("tp_size", 1), "tp_size", 1)
    pp = _size(get("pp_size", 1), "pp_size", 1)
    if pp > 1 and get("sequence_parallel", False):
        raise ConfigError("distributed.sequence_parallel: sequence parallelism with pipeline stages is not supported "
                          "yet; set sequence_parallel false (tensor parallelism alone works with pp_size)")
    if world_size % pp:
        raise ConfigError(f"distributed.pp_size ({pp}) does not divide the world size ({world_size}); start a "
                          f"multiple of {pp} processes or change distributed.pp_size")
    replicate = _size(get("dp_replicate_size", 1), "dp_replicate_size", 1)
    dp = get("dp_size", None)
    if dp is None:
        if world_size % (tp * pp):
            raise ConfigError(f"distributed.tp_size ({tp}) does not divide the world size ({world_size}); start a "
                              f"multiple of {tp} processes or change distributed.tp_size")
        dp = world_size // (tp * pp)
    dp = _size(dp, "dp_size", None)
    if dp * tp * pp != world_size:
        if pp > 1:
            raise ConfigError(f"distributed: dp_size × pp_size = {dp} × {pp} = {dp * pp} must equal the world size "
                              f"({world_size}); change the sizes (dp_size: null takes what pp_size leaves)")
        raise ConfigError(f"distributed: dp_size × tp_size = {dp} × {tp} = {dp * tp} must equal the world size "
                          f"({world_size}); change the sizes (dp_size: null takes what tp_size leaves)")
    if dp % replicate:
        raise ConfigError(f"distributed.dp_replicate_size ({replicate}) must divide dp_size ({dp}): HSDP shards "
                          "within each of dp_replicate_size groups of dp_size / dp_replicate_size ranks")
    sequence_parallel = bool(get("sequence_parallel", False))
    if sequence_parallel and tp == 1:
        raise ConfigError("distributed.sequence_parallel: true needs tensor parallelism (it splits the activations "
                          "over the tensor-parallel ranks); set distributed.tp_size > 1 or sequence_parallel false")
    if pp == 1:
        for key in ("pp_layers", "pp_microbatches"):
            if get(key, None) is not None:
                raise ConfigError(f"distributed.{key} needs pipeline stages; set distributed.pp_size > 1 or remove it")
    ep = _size(get("ep_size", 1), "ep_size", 1)
    if ep > 1:
        _check_expert_sizes(ep, dp // replicate, tp, pp, replicate)
    return MeshSizes(replicate, dp // replicate, tp, sequence_parallel, pp, ep)


def _check_expert_sizes(ep: int, dp_shard: int, tp: int, pp: int, replicate: int) -> None:
    """Expert-parallel sizes that do not fit a shard group of whole tensor-parallel groups: ``ConfigError``."""
    if ep % tp:
        raise ConfigError(f"distributed.ep_size ({ep}) must be a multiple of tp_size ({tp}): tensor-parallel peers "
                          "share their rows, and an ep group holds whole groups of them; change distributed.ep_size")
    if dp_shard * tp % ep:
        within = "dp_size / dp_replicate_size" if replicate > 1 else "the data-parallel size"
        within += f" × tp_size ({dp_shard} × {tp})" if tp > 1 else f" ({dp_shard})"
        raise ConfigError(f"distributed.ep_size ({ep}) must divide {within}: the experts are spread over groups of "
                          "ep_size ranks; change distributed.ep_size or the number of processes")


@dataclass(frozen=True)
class PipelinePlan:
    """How a run's pipeline runs: torch's schedule, microbatches per local batch, stages per rank
    (``interleaved_1f1b``: stage ``r + k × pp`` on rank ``r``) and each stage's decoder layers (None: even)."""

    schedule: str = "1f1b"
    microbatches: int = 1
    layers: tuple[int, ...] | None = None
    stages_per_rank: int = 1

    def stage_layers(self, num_layers: int, stages: int) -> list[range]:
        """The decoder layers of each of ``stages`` stages (whole-model indices)."""
        counts = list(self.layers) if self.layers else [num_layers // stages + (i < num_layers % stages)
                                                          for i in range(stages)]
        starts = [sum(counts[:i]) for i in range(stages)]
        return [range(start, start + n) for start, n in zip(starts, counts)]

    def stages(self, pp_size: int) -> int:
        """The number of stages over ``pp_size`` pipeline ranks."""
        return pp_size * self.stages_per_rank

    def rank_stages(self, pp_rank: int, pp_size: int) -> list[int]:
        """The stages pipeline rank ``pp_rank`` holds, in the order the model runs them."""
        return [pp_rank + k * pp_size for k in range(self.stages_per_rank)]

    def describe(self) -> str:
        """``1f1b, 4 microbatches`` (with ``, 2 stages per rank`` when interleaved)."""
        per_rank = f", {self.stages_per_rank} stages per rank" if self.stages_per_rank > 1 else ""
        return f"{self.schedule}, {self.microbatches} microbatches{per_rank}"


def resolve_pipeline(section: Any, sizes: MeshSizes, local_batch_size: int,
                     num_layers: int | None = None) -> PipelinePlan:
    """The pipeline ``distributed.pp_*`` asks for on ``sizes`` (and ``num_layers``); one-line ``ConfigError`` else."""
    get = section.get if hasattr(section, "get") else lambda key, default=None: getattr(section, key, default)
    pp = sizes.pp
    schedule = str(get("pp_schedule", None) or "1f1b").lower()
    if schedule not in PP_SCHEDULES:
        raise ConfigError(f"distributed.pp_schedule: expected one of {', '.join(PP_SCHEDULES)}, got '{schedule}'")
    interleaved = schedule == "interleaved_1f1b"
    per_rank = _size(get("pp_stages_per_rank", None), "pp_stages_per_rank", 2 if interleaved else 1)
    if per_rank > 1 and not interleaved:
        raise ConfigError(f"distributed.pp_stages_per_rank ({per_rank}): several stages per rank need pp_schedule "
                          f"interleaved_1f1b ({schedule} runs one stage per rank); set it or use 1")
    stages = pp * per_rank  # what PipelinePlan.stages(pp) gives
    microbatches = _size(get("pp_microbatches", None), "pp_microbatches", pp)
    if schedule == "1f1b" and microbatches < pp:
        raise ConfigError(f"distributed.pp_microbatches ({microbatches}) must be at least pp_size ({pp}) with the "
                          "1f1b schedule; raise it or use pp_schedule gpipe")
    rounds = max(1, microbatches // pp)
    if interleaved and microbatches % rounds:
        raise ConfigError(f"distributed.pp_microbatches ({microbatches}) must be a multiple of the interleaved "
                          f"schedule's rounds ({rounds} = pp_microbatches // pp_size); use {rounds * pp} or a "
                          "multiple of pp_size")
    if local_batch_size % microbatches:
        raise ConfigError(f"distributed.pp_microbatches ({microbatches}) must divide step_scheduler.local_batch_size "
                          f"({local_batch_size}): each microbatch holds local_batch_size / pp_microbatches rows; "
                          "change either")
    layers = get("pp_layers", None)
    if layers is not None:
        layers = tuple(layers)
        if len(layers) != stages or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in layers):
            product = f", pp_size × pp_stages_per_rank = {pp} × {per_rank}" if per_rank > 1 else ""
            raise ConfigError(f"distributed.pp_layers: expected {stages} positive integers (the decoder layers of "
                              f"each stage{product}), got {list(layers)}")
    if num_layers is not None:
        if stages > num_layers:
            several = f" × pp_stages_per_rank ({per_rank}) = {stages} stages" if per_rank > 1 else ""
            raise ConfigError(f"distributed.pp_size ({pp}){several} is larger than the model's {num_layers} decoder "
                              "layers: every stage needs at least one; use fewer stages")
        if layers is not None and sum(layers) != num_layers:
            raise ConfigError(f"distributed.pp_layers {list(layers)} sum to {sum(layers)}, not the model's "
                              f"{num_layers} decoder layers; change the counts")
    return PipelinePlan(schedule, microbatches, layers, per_rank)


def _size(value: Any, key: str, default: int | None) -> int:
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"distributed.{key}: expected a positive integer, got {value!r}")
    return value


@dataclass
class ParallelDims:
    """This rank's place on the mesh, and the meshes and groups each job uses.

    ``dp_group``: the group that sums losses and token counts (None: every rank). With expert parallelism,
    ``expert_mesh`` is ``([dp_replicate,] efsdp, ep)``: ``fully_shard`` shards the experts over ``efsdp``, spreads
    them over ``ep``; ``batch_mesh``: the ranks that hold the same rows (the tensor-parallel peers, else this rank)."""

    sizes: MeshSizes
    rank: int
    mesh: Any = None
    fsdp_mesh: Any = None
    tp_mesh: Any = None
    dp_group: Any = None

    pp_group: Any = None
    expert_mesh: Any = None
    batch_mesh: Any = None

    @property
    def tp_rank(self) -> int:
        return self.rank % self.sizes.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.sizes.tp % self.sizes.dp

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.sizes.dp * self.sizes.tp)

    pp_size = property(attrgetter("sizes.pp"))
    dp_size = property(attrgetter("sizes.dp"))
    tp_size = property(attrgetter("sizes.tp"))

    @property
    def writes_rank_state(self) -> bool:
        """Whether this rank writes its data-parallel rank's small files: the first of its peers and stages."""
        return self.tp_rank == 0 and self.pp_rank == 0

    def sum_over_dp(self, value: Any) -> Any:
        """``value`` summed over the data-parallel ranks (float64 on the CPU), each counted once."""
        from automodel_ckpt.distributed.env import all_reduce_sum

        return all_reduce_sum(value, group=self.dp_group)

    def sum_over_stages(self, value: Any) -> Any:
        """``value`` summed over the pipeline stages of this rank's data-parallel rank (itself without stages)."""
        if self.pp_group is None:
            return value
        from automodel_ckpt.distributed.env import all_reduce_sum

        return all_reduce_sum(value, group=self.pp_group)

    @classmethod
    def single(cls, rank: int = 0, world_size: int = 1) -> ParallelDims:
        """A 1-D data-parallel layout without meshes (what a caller that builds no mesh gets)."""
        return cls(MeshSizes(1, world_size, 1), rank)


def build_parallel_dims(sizes: MeshSizes, rank: int, device_type: str) -> ParallelDims:
    """Create the device mesh of ``sizes`` (collective): ``("dp",)`` for the 1-D default, else the dimensions
    larger than one of ``pp``, ``dp_replicate``, ``dp_shard`` (always: ``fully_shard`` needs one) and ``tp``."""
    from torch.distributed.device_mesh import init_device_mesh

    expert_mesh = None
    if sizes.ep > 1:  # a mesh of its own over the same ranks, as transformers lays experts out
        dims = [("efsdp", sizes.dp_shard * sizes.tp // sizes.ep), ("ep", sizes.ep)] + [("batch", 1)] * (sizes.tp == 1)
        if sizes.dp_replicate > 1:
            dims.insert(0, ("dp_replicate", sizes.dp_replicate))
        within = tuple(n for n, _ in dims)  # a stage's ranks: with pipeline stages, each stage has its own experts
        if sizes.pp > 1:
            dims.insert(0, ("pp", sizes.pp))
        expert_mesh = init_device_mesh(device_type, tuple(n for _, n in dims), mesh_dim_names=tuple(n for n, _ in dims))
        expert_mesh = expert_mesh[within] if sizes.pp > 1 else expert_mesh
    if sizes.tp == 1 and sizes.dp_replicate == 1 and sizes.pp == 1:
        mesh = init_device_mesh(device_type, (sizes.world_size,), mesh_dim_names=("dp",))
        return ParallelDims(sizes, rank, mesh, fsdp_mesh=mesh, expert_mesh=expert_mesh,
                            batch_mesh=expert_mesh["batch"] if expert_mesh is not None else None)
    dims = [("dp_shard", sizes.dp_shard)] + [("tp", sizes.tp)] * (sizes.tp > 1)  # dp_shard even of size 1
    if sizes.dp_replicate > 1:
        dims.insert(0, ("dp_replicate", sizes.dp_replicate))
    if sizes.pp > 1:
        dims.insert(0, ("pp", sizes.pp))
    names = tuple(n for n, _ in dims)
    mesh = init_device_mesh(device_type, tuple(s for _, s in dims), mesh_dim_names=names)
    dp_names = tuple(n for n in names if n not in ("tp", "pp"))
    fsdp_mesh = mesh[dp_names]
    tp_mesh = mesh["tp"] if sizes.tp > 1 else None
    dp_group = None  # with one stage and without tensor parallelism the data-parallel ranks are every rank
    if sizes.tp > 1 or sizes.pp > 1:  # sum over this stage's data-parallel ranks only
        dp_group = (mesh[dp_names]._flatten("dp") if len(dp_names) == 2 else mesh[dp_names[0]]).get_group()
    pp_group = mesh["pp"].get_group() if sizes.pp > 1 else None
    batch_mesh = None if expert_mesh is None else tp_mesh if tp_mesh is not None else expert_mesh["batch"]
    return ParallelDims(sizes, rank, mesh, fsdp_mesh=fsdp_mesh, tp_mesh=tp_mesh, dp_group=dp_group,
                        pp_group=pp_group, expert_mesh=expert_mesh, batch_mesh=batch_mesh)
