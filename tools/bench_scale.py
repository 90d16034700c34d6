"""How checkpoint coordination grows with the rank count: save, load and publish with 2 to 32 gloo ranks, or the
coordinator's work at 256 to 4,096 ranks simulated in one process.

    python tools/bench_scale.py [--ranks 2,4,8,16,32] [--reps 3] [--json OUT]
    python tools/bench_scale.py --small --json OUT     # 2 and 3 ranks, one repetition: checks the tool
    python tools/bench_scale.py --simulate-ranks 256,1024,4096 --layout llama3-70b [--strategy fsdp] --json OUT
    python tools/bench_scale.py --simulate-ranks 256,1024,4096 --layout llama3-70b --end-to-end --json OUT

``--simulate-ranks`` (``scale_sim.py``): every rank's local save plan as DCP makes it for the layout's DTensors
(``--layout llama3-70b|llama3-8b|moe|tiny``, ``--strategy fsdp|hsdp|tp-fsdp``), sent to the coordinator through
the product's planner (``LinearSavePlanner``); the coordinator's CPU seconds of a first save (planned), the next
one (cached), a load at the same rank count and one at three quarters of it (resharded), and the bytes each rank
sends the coordinator in a save (plan, write results, checksums). ``--dump-plans DIR``: rank 0 of a real run (and
a simulation) pickles the model save's final plans and metadata there (compared by the tests).
``--end-to-end`` (``scale_e2e.py``): the whole save at each rank count, a first and a next one: both states'
planning, the optimizer's ``.metadata``, the failure flags, the manifest, the commit (rank 0's CPU seconds of
each), the object-store requests and the bytes rank 0 receives; with ``--dump-plans`` the optimizer's final plans,
metadata and ``.metadata`` file too.

For each rank count, ``torchrun --standalone`` starts that many CPU processes on this machine; each holds a tiny
FSDP2-sharded model (a few KiB per rank, so coordination dominates) with AdamW state and saves it ``--reps``
times through the ``Checkpointer`` (synchronous, safetensors), then loads the last checkpoint. Rank 0 reports
the median seconds of each phase:

* ``reserve``: the collective agreement on the staging folder (rank 0 decides, every rank learns it);
* ``plan_local`` / ``plan_global``: DCP's save planning (global: rank 0 merges every rank's plan);
* ``write_sharded``: the whole sharded save (planning, writing, DCP's metadata commit);
* ``write_local``: per-rank state, config and metadata files;
* ``sync``, ``manifest`` (checksums gathered to rank 0, manifest written), ``publish`` (rename, LATEST);
* ``load``: verifying the manifest and reading the checkpoint back.

It also counts the bytes that object collectives (``all_gather_object``, ``broadcast_object_list``, ...) move
per rank and per save (``object_bytes``): checksums and plans, never tensors. All ranks share this machine's cores,
so every phase also carries the cost of running N processes on them: read the growth between rows, not the
absolute times. ``growth`` is each phase's time at the largest rank count over the smallest, divided by the rank
ratio: at most 1 means at most linear.

Times internals: imports ``ondisk.saveplan`` and ``ondisk.fastio`` (the planner it times, its caches) directly.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RANKS = (2, 4, 8, 16, 32)
PHASES = ("reserve", "plan_local", "plan_global", "write_sharded", "write_local", "sync", "manifest", "publish",
          "save", "load")


def worker(out: Path, reps: int, dump: Path | None = None) -> None:
    """One rank: build, step, save ``reps`` times, load; rank 0 writes its timings to ``out``."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from automodel_ckpt.checkpoint import CheckpointConfig, Checkpointer
    from automodel_ckpt.checkpoint import SaveInfo
    from automodel_ckpt.ondisk.saveplan.planning import LinearSavePlanner
    from automodel_ckpt.distributed.env import end_process, init_distributed, shutdown_distributed

    env = init_distributed("gloo")
    timers: dict[str, list[float]] = {}
    counted = {"object_bytes": 0}

    def timed(owner, name: str, phase: str) -> None:
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                timers.setdefault(phase, []).append(time.perf_counter() - t0)

        setattr(owner, name, wrapper)

    timed(LinearSavePlanner, "create_local_plan", "plan_local")
    timed(LinearSavePlanner, "create_global_plan", "plan_global")
    if dump is not None:
        finish_plan = LinearSavePlanner.finish_plan

        def dumping(self, new_plan):  # every rank's final plan of each save, and the metadata
            final = finish_plan(self, new_plan)
            folder = self.key.rsplit("/", 1)[-1].split(":")[0]  # the key: <root>/<state folder>:<writer>
            prefix = {"model": "", "optim": "optim_"}.get(folder)
            if prefix is not None:
                (dump / f"{prefix}final_{env.world_size}_{env.rank}.pkl").write_bytes(pickle.dumps(final))
                if env.is_main:
                    (dump / f"{prefix}metadata_{env.world_size}.pkl").write_bytes(pickle.dumps(self.metadata))
            return final

        LinearSavePlanner.finish_plan = dumping
    c10d = dist.distributed_c10d
    to_tensor = c10d._object_to_tensor

    def counting(obj, *args, **kwargs):
        tensor, size = to_tensor(obj, *args, **kwargs)
        counted["object_bytes"] += int(size.sum()) if hasattr(size, "sum") else int(size)
        return tensor, size

    c10d._object_to_tensor = counting

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    mesh = init_device_mesh("cpu", (env.world_size,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 16)).sum().backward()
    optim.step()
    root = out.parent / f"ckpt_{env.world_size}"
    cfg = CheckpointConfig(checkpoint_dir=str(root), save_consolidated="false", max_recent_checkpoints=1)
    ckpt = Checkpointer(cfg, env, resolved_config_yaml="bench: scale\n", say=lambda _m: None)
    states = {"model": model, "optimizer": optim}
    path = None
    for step in range(1, reps + 1):
        before = counted["object_bytes"]
        dist.barrier()
        t0 = time.perf_counter()
        path = ckpt.save(states, SaveInfo(epoch=0, step=step, train_loss=1.0, val_loss=None, is_final=False))
        timers.setdefault("save", []).append(time.perf_counter() - t0)
        timers.setdefault("object_bytes", []).append(counted["object_bytes"] - before)
        for phase, seconds in (ckpt.stats.last_save_seconds | ckpt.stats.last_complete_seconds).items():
            timers.setdefault(phase, []).append(seconds)
    dist.barrier()
    t0 = time.perf_counter()
    ckpt.load(states, path)
    timers["load"] = [time.perf_counter() - t0]
    if dump is not None and env.is_main:  # the last save's optimizer index, as written
        (dump / f"optim_file_{env.world_size}.bin").write_bytes((Path(path) / "optim" / ".metadata").read_bytes())
    if env.is_main:
        out.write_text(json.dumps({"world_size": env.world_size, "timers": timers}))
    shutdown_distributed()
    end_process(0)  # a rank never meets interpreter teardown (see end_process)


def run(ranks: int, reps: int, work: Path, dump: Path | None = None) -> dict:
    out = work / f"scale_{ranks}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
           str(Path(__file__).resolve()), "--worker", str(out), "--reps", str(reps),
           *(["--dump-plans", str(dump)] if dump is not None else [])]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), TORCH_CPP_LOG_LEVEL="ERROR")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not out.is_file():
        raise SystemExit(f"{ranks} ranks failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    data = json.loads(out.read_text())
    data["wall"] = time.perf_counter() - t0
    data["median"] = {k: statistics.median(v) for k, v in data["timers"].items() if v}
    return data


def summary(results: dict[int, dict]) -> dict:
    """Per phase: the median seconds per rank count and the growth factor (see the module docstring)."""
    counts = sorted(results)
    phases = [p for p in (*PHASES, "object_bytes") if all(p in results[n]["median"] for n in counts)]
    table = {p: {str(n): results[n]["median"][p] for n in counts} for p in phases}
    growth = {}
    if len(counts) > 1:
        lo, hi = counts[0], counts[-1]
        for p in phases:
            a, b = results[lo]["median"][p], results[hi]["median"][p]
            growth[p] = (b / a) / (hi / lo) if a > 0 else None
    return {"ranks": counts, "phases": table, "growth": growth}


def print_table(report: dict) -> None:
    counts = report["ranks"]
    print("| phase | " + " | ".join(f"{n} ranks" for n in counts) + " | growth / linear |")
    print("|---|" + "---|" * (len(counts) + 1))
    for phase, row in report["phases"].items():
        unit = "B" if phase == "object_bytes" else "s"
        cells = [f"{row[str(n)]:.0f}" if unit == "B" else f"{row[str(n)]:.4f}" for n in counts]
        g = report["growth"].get(phase)
        print(f"| {phase} ({unit}) | " + " | ".join(cells) + f" | {'-' if g is None else f'{g:.2f}'} |")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default=",".join(map(str, RANKS)))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--small", action="store_true", help="2 and 3 ranks, one repetition")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--simulate-ranks", default=None, help="rank counts to simulate in one process")
    parser.add_argument("--layout", default="llama3-70b", choices=("llama3-70b", "llama3-8b", "moe", "tiny"))
    parser.add_argument("--strategy", default="fsdp", choices=("fsdp", "hsdp", "tp-fsdp"))
    parser.add_argument("--end-to-end", action="store_true", help="with --simulate-ranks: the whole save")
    parser.add_argument("--dump-plans", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker(args.worker, args.reps, args.dump_plans)
        return {}
    if args.simulate_ranks and args.end_to_end:
        return simulate_whole([int(n) for n in args.simulate_ranks.split(",") if n.strip()], args.layout,
                              args.strategy, args.json, args.dump_plans)
    if args.simulate_ranks:
        return simulate([int(n) for n in args.simulate_ranks.split(",") if n.strip()], args.layout, args.strategy,
                        args.json, args.dump_plans)
    ranks = [2, 3] if args.small else [int(n) for n in args.ranks.split(",") if n.strip()]
    reps = 1 if args.small else args.reps
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_scale_") as tmp:
        for n in ranks:
            results[n] = run(n, reps, Path(tmp), args.dump_plans)
            print(f"{n} ranks: {results[n]['wall']:.0f} s", flush=True)
    report = summary(results) | {"reps": reps, "cpu_count": os.cpu_count()}
    print_table(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return report


def simulate(ranks: list[int], layout: str, strategy: str, out: Path | None, dump: Path | None = None) -> dict:
    """The coordinator's CPU seconds at each rank count (see the module docstring), printed and written to ``out``."""
    import scale_sim

    from automodel_ckpt.ondisk.saveplan.plan_results import clear_cache as clear_results_cache
    from automodel_ckpt.ondisk.saveplan.planning import clear_cache as clear_plan_cache

    report: dict = {"layout": layout, "strategy": strategy, "tensors": len(scale_sim.params(layout)), "ranks": [],
                    "first_save_s": [], "next_save_s": [], "load_s": [], "reshard_load_s": [],
                    "object_bytes_per_rank": [], "next_object_bytes_per_rank": []}
    for n in ranks:
        first = scale_sim.save(layout, strategy, n)
        assert not first["reused"], "a first save planned afresh"
        if dump is not None:
            for rank, final in enumerate(first["final_plans"]):
                (dump / f"sim_final_{n}_{rank}.pkl").write_bytes(pickle.dumps(final))
            (dump / f"sim_metadata_{n}.pkl").write_bytes(pickle.dumps(first["metadata"]))
        second = scale_sim.save(layout, strategy, n)
        assert second["reused"], "the next save of the same layout reused the cached plan"
        target = max(scale_sim.TP, (3 * n) // 4 // scale_sim.TP * scale_sim.TP) if strategy != "fsdp" else max(1, (3 * n) // 4)
        row = {"ranks": n, "first_save_s": first["seconds"], "next_save_s": second["seconds"],
               "load_s": scale_sim.load(layout, strategy, first["metadata"], n),
               "reshard_load_s": scale_sim.load(layout, strategy, first["metadata"], target),
               "object_bytes_per_rank": first["object_bytes_per_rank"],
               "next_object_bytes_per_rank": second["object_bytes_per_rank"]}
        del first, second
        clear_plan_cache()  # the next rank count's plans only
        clear_results_cache()
        for k, v in row.items():
            report[k].append(v)
        print(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    report["cpu_count"] = os.cpu_count()
    if out:
        out.write_text(json.dumps(report, indent=1))
    return report


E2E_FIELDS = ("plan_s", "metadata_s", "metadata_wall_s", "broadcast_s", "flags_s", "manifest_s", "commit_s",
              "total_s", "object_store_requests", "bytes_to_rank0", "broadcast_bytes")


def simulate_whole(ranks: list[int], layout: str, strategy: str, out: Path | None, dump: Path | None = None) -> dict:
    """The whole save at each rank count (``scale_e2e``): a first save and the next one, rank 0's seconds of each
    step, printed and written to ``out``; ``growth``: the total's at the largest rank count over the smallest."""
    import shutil

    import scale_e2e

    from automodel_ckpt.ondisk.saveplan import plan_results, planning
    from automodel_ckpt.ondisk.fastio import metafile

    report: dict = {"layout": layout, "strategy": strategy, "rows": []}
    for n in ranks:
        root, started = Path(tempfile.mkdtemp(prefix="bench_scale_e2e_")), time.perf_counter()
        try:
            first = scale_e2e.save(layout, strategy, n, root, 1)
            assert not first["reused"], "a first save planned afresh"
            if dump is not None:
                for prefix, saved in (("", first["model"]), ("optim_", first["optim"])):
                    for rank, final in enumerate(saved.finals or []):
                        (dump / f"sim_{prefix}final_{n}_{rank}.pkl").write_bytes(pickle.dumps(final))
                    (dump / f"sim_{prefix}metadata_{n}.pkl").write_bytes(pickle.dumps(saved.metadata))
                (dump / f"sim_optim_file_{n}.bin").write_bytes((first["folder"] / "optim" / ".metadata").read_bytes())
            del first["model"], first["optim"]
            shutil.rmtree(first["folder"])
            following = scale_e2e.save(layout, strategy, n, root, 2)
            assert following["reused"], "the next save of the same layout reused the cached plans"
            del following["model"], following["optim"]
        finally:
            shutil.rmtree(root, ignore_errors=True)
            for module in (planning, plan_results, metafile):
                module.clear_cache()
        row = {"ranks": n, "first": {k: first[k] for k in E2E_FIELDS}, "next": {k: following[k] for k in E2E_FIELDS},
               "wall_s": time.perf_counter() - started,  # both saves, with the simulation's own set-up
               "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)}  # the process so far
        report["rows"].append(row)
        print(f"{n} ranks: {row['wall_s']:.0f} s of wall time, peak {row['peak_rss_gib']:.2f} GiB", flush=True)
        for which in ("first", "next"):
            print(f"{n} ranks, {which}: " + " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}"
                                                       for k, v in row[which].items()), flush=True)
    if len(report["rows"]) > 1:
        lo, hi = report["rows"][0], report["rows"][-1]
        report["growth"] = {w: hi[w]["total_s"] / lo[w]["total_s"] for w in ("first", "next") if lo[w]["total_s"]}
    report["cpu_count"] = os.cpu_count()
    if out:
        out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
