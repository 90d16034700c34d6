"""Which node each rank is on, and which ranks on other nodes keep copies of whose part.

Node ``n`` is ranks ``n * ranks_per_node`` on (torchrun's numbering); copy ``k = 1 .. copies`` of rank ``r``'s part
is kept by rank ``(r + k * ranks_per_node) mod world_size``, on another node each.
"""

from __future__ import annotations

from dataclasses import dataclass

from automodel_ckpt.errors import CheckpointError


@dataclass(frozen=True)
class Placement:
    """The nodes of a run and who keeps copies of whose part (``place`` makes one, checked)."""

    rank: int
    world_size: int
    ranks_per_node: int
    copies: int  # the copies of each part kept on other nodes: checkpoint.local.replicas, capped at nodes - 1
    warning: str | None = None  # why fewer copies are kept than asked for, for the caller to show

    @property
    def nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def node_of(self, rank: int | None = None) -> int:
        """The node ``rank`` (default: this rank) runs on."""
        return self._checked(rank) // self.ranks_per_node

    def _checked(self, rank: int | None) -> int:
        rank = self.rank if rank is None else rank
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size} ranks")
        return rank


def place(rank: int, world_size: int, ranks_per_node: int, replicas: int) -> Placement:
    """The placement of ``world_size`` ranks, ``replicas`` copies of each part (fewer, with a ``warning``)."""
    if ranks_per_node < 1 or world_size < 1 or world_size % ranks_per_node:
        raise CheckpointError(f"checkpoint.local: {world_size} ranks cannot be spread evenly over nodes of "
                              f"{ranks_per_node} ranks (LOCAL_WORLD_SIZE); node-local steps need nodes of the same "
                              "number of processes")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size} ranks")
    if replicas < 0:
        raise ValueError(f"replicas must be >= 0, got {replicas}")
    others = world_size // ranks_per_node - 1
    copies, warning = min(replicas, others), None
    if replicas > others == 0:
        warning = (f"checkpoint.local.replicas: {replicas} asked for, but the run has one node: no copies are kept "
                   "on other nodes, so losing this node loses its node-local steps (the durable tier remains)")
    elif replicas > others:
        warning = (f"checkpoint.local.replicas: {replicas} asked for, but the run has only {others} other "
                   f"node{'s' if others > 1 else ''}: keeping {copies} cop{'ies' if copies > 1 else 'y'} of each part")
    return Placement(rank, world_size, ranks_per_node, copies, warning)
