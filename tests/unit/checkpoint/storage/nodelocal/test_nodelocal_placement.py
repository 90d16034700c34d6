"""Node-local placement: which node a rank is on, who keeps copies of whose part, and replicas capped by nodes."""

from __future__ import annotations

import pytest

from automodel_ckpt.checkpoint.storage.nodelocal.placement import place
from automodel_ckpt.errors import CheckpointError


def replica_ranks(p, rank=None):
    """The ranks, each on another node, that keep a copy of ``rank``'s part: the module's rule, written out."""
    rank = p.rank if rank is None else rank
    return [(rank + k * p.ranks_per_node) % p.world_size for k in range(1, p.copies + 1)]


def held_for(p, rank=None):
    """The ranks whose parts ``rank`` keeps copies of."""
    rank = p.rank if rank is None else rank
    return [(rank - k * p.ranks_per_node) % p.world_size for k in range(1, p.copies + 1)]


def test_copies_go_to_the_same_local_rank_on_the_next_nodes():
    p = place(rank=1, world_size=8, ranks_per_node=2, replicas=2)
    assert p.nodes == 4 and p.copies == 2 and p.warning is None
    assert [p.node_of(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert replica_ranks(p) == [3, 5]
    assert replica_ranks(p, 7) == [1, 3]  # wraps around
    assert held_for(p) == [7, 5]
    assert held_for(p, 3) == [1, 7]


@pytest.mark.parametrize("world,per_node,replicas", [(8, 2, 1), (8, 2, 3), (12, 4, 2), (6, 1, 5), (4, 4, 0)])
def test_every_copy_is_on_another_node_and_held_for_inverts_replica_ranks(world, per_node, replicas):
    p = place(0, world, per_node, replicas)
    for rank in range(world):
        nodes = [p.node_of(r) for r in replica_ranks(p, rank)]
        assert p.node_of(rank) not in nodes and len(set(nodes)) == len(nodes) == p.copies
        for holder in replica_ranks(p, rank):
            assert rank in held_for(p, holder)
        assert sorted(r for r in range(world) if rank in replica_ranks(p, r)) == sorted(held_for(p, rank))


def test_replicas_beyond_the_other_nodes_are_capped_with_a_warning():
    p = place(0, 4, 2, replicas=3)
    assert p.copies == 1 and "only 1 other node: keeping 1 copy of each part" in p.warning
    alone = place(0, 4, 4, replicas=1)
    assert alone.copies == 0 and replica_ranks(alone) == [] and held_for(alone) == []
    assert "one node" in alone.warning
    assert place(0, 4, 4, replicas=0).warning is None  # none asked for, none missed


def test_uneven_nodes_and_bad_ranks_are_refused():
    with pytest.raises(CheckpointError, match="6 ranks cannot be spread evenly over nodes of 4 ranks"):
        place(0, 6, 4, 1)
    with pytest.raises(ValueError, match="rank 4 is outside"):
        place(4, 4, 2, 1)
    with pytest.raises(ValueError, match="rank 9 is outside"):
        place(0, 4, 2, 1).node_of(9)
