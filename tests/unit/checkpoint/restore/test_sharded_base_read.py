"""Reading a safetensors folder into DTensors of any placement reads only each rank's bytes (2 real processes)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import save_file

from automodel_ckpt.ondisk.fastio.readers import runs

SHAPE = (6, 10)


def _tensor() -> torch.Tensor:
    return torch.arange(SHAPE[0] * SHAPE[1], dtype=torch.float32).reshape(SHAPE).to(torch.bfloat16)


@pytest.mark.parametrize("offsets,lengths", [((0, 1, 0, 0), (2, 2, 4, 5)), ((1, 0, 1, 2), (1, 3, 2, 3)),
                                             ((0, 0, 0, 1), (2, 3, 4, 2)), ((0, 0, 0, 0), (2, 3, 4, 5))])
def test_runs_cover_exactly_the_piece(offsets, lengths):
    t = torch.arange(2 * 3 * 4 * 5).reshape(2, 3, 4, 5)
    starts, n = runs(tuple(t.shape), offsets, lengths)
    got = torch.cat([t.reshape(-1)[s:s + n] for s in starts]).view(lengths)
    assert torch.equal(got, t[tuple(slice(o, o + k) for o, k in zip(offsets, lengths))])


def _worker(rank: int, folder: str, port: int, out: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from automodel_ckpt.ondisk.fastio.common import BYTES_READ
    from automodel_ckpt.ondisk.fastio.readers import ParallelHFReader

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        result = {}
        for placement in (Shard(0), Shard(1), Replicate()):
            target = distribute_tensor(torch.zeros(SHAPE), mesh, [placement])  # fp32: read bf16, cast on the way
            before = BYTES_READ.total
            dcp.load({"w": target}, storage_reader=ParallelHFReader(folder))
            expected = distribute_tensor(_tensor().float(), mesh, [placement]).to_local()
            result[type(placement).__name__ + str(getattr(placement, "dim", ""))] = (BYTES_READ.total - before, torch.equal(target.to_local(), expected),
                                      expected.numel() * 2)
        torch.save(result, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_each_placement_reads_the_bytes_of_the_local_slice_only(tmp_path: Path):
    save_file({"w": _tensor()}, str(tmp_path / "model.safetensors"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_worker, args=(str(tmp_path), port, str(tmp_path)), nprocs=2, start_method="spawn")
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        for placement, (read, equal, local_bytes) in result.items():
            assert equal, (rank, placement)
            assert read == local_bytes, (rank, placement, read, local_bytes)  # Shard(1): column runs, not whole rows
    assert torch.load(tmp_path / "rank0.pt")["Replicate"][0] == _tensor().numel() * 2  # every rank: the whole tensor
