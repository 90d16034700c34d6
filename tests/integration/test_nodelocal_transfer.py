"""Node-local transfer between real processes (3 ranks on gloo, each a simulated node): files go round a ring
(every rank sends and receives at once), an unsafe name is refused on both ends, and gather + choose + fill_plan +
exchange complete the folders of two nodes that each lost another rank's part."""

from __future__ import annotations

import json
from pathlib import Path

import torch.multiprocessing as mp

from tests.unit.checkpoint.storage.nodelocal.test_nodelocal_inventory import write_step

WORLD, PER_NODE = 3, 1
STEP = "epoch_0_step_6"


def part(rank: int) -> dict[str, bytes]:
    """Rank ``rank``'s files of a step: a model shard of several chunks and a small per-rank file."""
    return {f"model/shard-{rank}.safetensors": bytes([rank]) * (5000 + 777 * rank),
            f"rng/rng_dp_rank_{rank}.pt": f"rng {rank}".encode()}


def _worker(rank: int, tmp: str) -> None:
    import torch.distributed as dist

    from automodel_ckpt.ondisk import manifest
    from automodel_ckpt.checkpoint.storage.nodelocal.inventory import (choose, fill_plan, gather, receives_from, scan,
                                                                       sends)
    from automodel_ckpt.checkpoint.storage.nodelocal.transfer import exchange
    from automodel_ckpt.checkpoint.storage.nodelocal.placement import place
    from automodel_ckpt.errors import CheckpointError

    root = Path(tmp)
    dist.init_process_group("gloo", init_method=f"file://{root / 'rendezvous'}", rank=rank, world_size=WORLD)
    try:
        # 1. every rank sends its part to its replica on the next node and receives the part it keeps: 0->1->2->0
        placement = place(rank, WORLD, PER_NODE, replicas=1)
        holder, owner = (rank + PER_NODE) % WORLD, (rank - PER_NODE) % WORLD  # the next node's, the previous one's
        assert placement.copies == 1
        got = exchange({holder: sorted(part(rank))}, root / "parts" / str(rank),
                       {owner: root / "copies" / str(rank)}, chunk_bytes=1024)
        assert got == {owner: sorted(part(owner))}
        for rel, data in part(owner).items():
            assert (root / "copies" / str(rank) / rel).read_bytes() == data

        # 2. a name leading out of the folder is refused on both ends; the others go on
        if rank in (0, 1):
            try:
                exchange({1: ["../outside"]} if rank == 0 else {}, root / "parts" / "0",
                         {0: root / "refused"} if rank == 1 else {})
                raise AssertionError("an unsafe name was sent")
            except CheckpointError as exc:
                assert "names the unsafe path '../outside'" in str(exc) and "\n" not in str(exc), str(exc)
        dist.barrier()

        # 3. node 1 lost rank 0's part, node 0 lost rank 2's: the fill completes both folders
        folder = root / f"node{placement.node_of()}"
        inventories = gather(scan(folder))
        chosen = choose(inventories)
        assert chosen is not None and chosen.name == STEP
        plan = fill_plan(inventories, chosen)
        step = folder / chosen.name
        exchange(sends(plan, rank), step, {src: step for src in receives_from(plan, rank)},
                 expected=manifest.read_manifest(step), chunk_bytes=2048)
        dist.barrier()
        after = scan(folder).steps[STEP]
        assert after.present == after.listed and after.digest == chosen.digest
        with open(root / f"plan-{rank}.json", "w") as f:
            json.dump([[t.sender, t.receiver, list(t.files)] for t in plan], f)
    finally:
        dist.destroy_process_group()


def test_exchange_moves_files_both_ways_refuses_unsafe_names_and_fills_a_lost_part(tmp_path: Path):
    for rank in range(WORLD):
        for rel, data in part(rank).items():
            (tmp_path / "parts" / str(rank) / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / "parts" / str(rank) / rel).write_bytes(data)
    every = {"metadata.json": b'{"step": 6}', **{k: v for r in range(WORLD) for k, v in part(r).items()}}
    write_step(tmp_path / "node0", STEP, every, present=[r for r in every if r not in part(2)])
    write_step(tmp_path / "node1", STEP, every, present=[r for r in every if r not in part(0)])
    write_step(tmp_path / "node2", STEP, every)

    mp.start_processes(_worker, args=(str(tmp_path),), nprocs=WORLD, start_method="spawn")

    assert not (tmp_path / "outside").exists() and not (tmp_path / "refused" / "outside").exists()
    plan = json.loads((tmp_path / "plan-0.json").read_text())
    assert all(json.loads((tmp_path / f"plan-{r}.json").read_text()) == plan for r in range(WORLD))  # one plan
    moved = {rel: (sender, receiver) for sender, receiver, files in plan for rel in files}
    assert {rel: receiver for rel, (_, receiver) in moved.items()} == {**dict.fromkeys(part(0), 1),
                                                                       **dict.fromkeys(part(2), 0)}
    assert all(sender in (0, 2) for rel, (sender, _) in moved.items() if rel in part(0))  # from a node that has it
    assert all(sender in (1, 2) for rel, (sender, _) in moved.items() if rel in part(2))
