"""Save and load on 2-D meshes beside a 1-D one (``bench_checkpoint.py --mesh``): dp 4, dp 2 × tp 2, HSDP 2 × 2.

The benchmark's Llama state (model + AdamW moments) is sharded as the trainer shards it under each layout (tensor
parallelism from the family's plan, then ``fully_shard`` over the data-parallel mesh, or HSDP's 2-D mesh) and saved
and loaded by ``Checkpointer`` in safetensors shards, with ``--nproc`` 4 ranks. The rows go beside the raw write and
read of the same bytes by 4 writers (and the O_DIRECT device reference) as the other rows of the table; each save
also reports the bytes it put on disk (HSDP: each byte once, as dp).
"""

from __future__ import annotations

import argparse
import time

#: method suffix -> (dp_replicate, dp_shard, tp) on 4 ranks
MESHES = {"dp": (1, 4, 1), "dp_tp": (1, 2, 2), "hsdp": (2, 2, 1)}
SAVES = tuple(f"mesh_save_{m}" for m in MESHES)
LOADS = tuple(f"mesh_load_{m}" for m in MESHES)


def label(method: str) -> str:
    from automodel_ckpt.distributed.mesh import MeshSizes

    name = method.split("_", 2)[2]
    return f"**ours, safetensors, {MeshSizes(*MESHES[name]).describe()}**"


def labels() -> dict[str, str]:
    return {m: label(m) for m in SAVES + LOADS}


def child(args: argparse.Namespace, bench) -> None:
    """One timed save or load on the mesh the method names (rank 0 reports ``seconds`` and ``bytes_on_disk``)."""
    import torch.distributed as dist

    from automodel_ckpt.checkpoint import SaveInfo
    from automodel_ckpt.distributed.env import end_process, shutdown_distributed
    from automodel_ckpt.distributed.mesh import MeshSizes, build_parallel_dims

    method = args.child
    op, name = method.split("_", 2)[1:]
    env = bench.dist_env(args.device)
    sizes = MeshSizes(*MESHES[name])
    if sizes.world_size != env.world_size:
        raise SystemExit(f"{method}: needs {sizes.world_size} ranks, got {env.world_size} (--nproc 4)")
    dims = build_parallel_dims(sizes, env.rank, env.device.type)
    states = bench.build_state(args.layers, env, with_moments=op == "save", dims=dims)
    result: dict = {}
    dist.barrier()
    if op == "save":
        out = args.dir / "out"
        ckpt = bench.checkpointer(env, out, "safetensors", dims=dims)
        t0 = bench._start_timing()
        ckpt.save(states, SaveInfo(epoch=0, step=1, train_loss=1.0, val_loss=1.0, is_final=False))
        result["seconds"] = time.perf_counter() - t0
        written = out / "epoch_0_step_1"
        result["bytes_on_disk"] = sum(f.stat().st_size for d in ("model", "optim") for f in (written / d).iterdir()
                                      if f.is_file())
    else:
        root = args.dir / "src" / f"mesh_save_{name}"
        ckpt = bench.checkpointer(env, root, "safetensors", dims=dims)
        t0 = bench._start_timing()
        ckpt.load(states, root / "epoch_0_step_1")
        dist.barrier()
        result["seconds"] = time.perf_counter() - t0
    shutdown_distributed()
    if env.rank == 0:
        bench._report(result)
    end_process(0)


def sections() -> list[tuple]:
    """The table's rows for ``bench_checkpoint.print_table``: (operation, methods, raw, raw same threads, peer,
    device); the peer of every mesh is dp 4."""
    return [("save on a mesh", list(SAVES), "raw_write", "raw_write_mt", "mesh_save_dp", "raw_write_direct"),
            ("load on a mesh", list(LOADS), "raw_read", "raw_read_mt", "mesh_load_dp", "raw_read_direct")]


def source_of(method: str) -> str | None:
    """The save a mesh load reads (written once before the timed runs)."""
    return method.replace("mesh_load_", "mesh_save_") if method in LOADS else None

