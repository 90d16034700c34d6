"""Which staged files of a local step go where: every node keeps its own parts, the parts of the nodes it keeps
copies for, and the files no one rank owns (the manifest among them)."""

from __future__ import annotations

from automodel_ckpt.checkpoint.storage.nodelocal.inventory import sends
from automodel_ckpt.checkpoint.storage.nodelocal.placement import place
from automodel_ckpt.checkpoint.storage.nodelocal.replicate import plan

COMMON = {"manifest.json": 900, "metadata.json": 300, "model/.metadata": 500}


def shard(rank: int) -> str:
    return f"model/__{rank}_0.distcp"


def listings_of(world: int, per_node: int) -> list[dict[str, int]]:
    """What each rank's folder holds right after the seal: node 0's also the common files (rank 0 wrote them)."""
    out = []
    for rank in range(world):
        node = rank // per_node
        files = {shard(r): 1000 + r for r in range(node * per_node, (node + 1) * per_node)}
        out.append(files | (COMMON if node == 0 else {}))
    return out


def holdings(listings, folders, transfers):
    """What each folder holds after the transfers."""
    held = {f: set(listings[folders.index(f)]) for f in set(folders)}
    for t in transfers:
        held[folders[t.receiver]] |= set(t.files)
    return held


def test_two_nodes_of_two_ranks_each_keep_everything_and_each_rank_sends_its_own_part():
    folders = ["A", "A", "B", "B"]
    listings = listings_of(4, 2)
    transfers = plan(listings, folders, place(0, 4, 2, 1))
    held = holdings(listings, folders, transfers)
    everything = {shard(r) for r in range(4)} | set(COMMON)
    assert held["A"] == everything and held["B"] == everything
    for t in transfers:
        for rel in t.files:
            assert rel in listings[t.sender]  # sent by a rank that holds it
            if rel.endswith(".distcp"):
                assert rel == shard(t.sender) and t.receiver % 2 == t.sender % 2  # its writer, to the same local rank
    assert list(sends(transfers, 1)) == [3] and shard(1) in sends(transfers, 1)[3]  # the rest: balanced


def test_three_nodes_with_one_copy_keep_the_previous_node_and_lose_nothing_when_any_node_is_lost():
    folders = ["A", "B", "C"]
    listings = listings_of(3, 1)
    held = holdings(listings, folders, plan(listings, folders, place(0, 3, 1, 1)))
    assert held["B"] == {shard(0), shard(1)} | set(COMMON)
    assert held["C"] == {shard(1), shard(2)} | set(COMMON)
    assert held["A"] == {shard(2), shard(0)} | set(COMMON)
    for lost in held:
        assert set().union(*(h for f, h in held.items() if f != lost)) >= {shard(r) for r in range(3)}


def test_no_copies_moves_only_the_common_files_and_a_shared_folder_moves_nothing():
    folders = ["A", "B"]
    listings = listings_of(2, 1)
    transfers = plan(listings, folders, place(0, 2, 1, 0))
    assert [(t.sender, t.receiver, set(t.files)) for t in transfers] == [(0, 1, set(COMMON))]
    assert plan(listings_of(2, 2), ["A", "A"], place(0, 2, 2, 1)) == []  # one node: nothing to copy
