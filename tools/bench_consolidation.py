#!/usr/bin/env python3
"""Benchmark HF consolidation: ours vs torch's consolidate_safetensors_files vs a raw sequential write.

Builds (once) per-rank safetensors shards of an fp32 Llama of about ``--size-mb`` with a 2-process FSDP2 run,
then times, on the same shards and interleaving repetitions:

* ``ours``        automodel_ckpt.export.plan.consolidate (fsyncs every file, atomic rename)
* ``torch``       torch.distributed.checkpoint._consolidate_hf_safetensors.consolidate_safetensors_files
                  (as shipped: no fsync)
* ``torch+fsync`` the same followed by an fsync of each output file (same durability as ours)
* ``raw``         a sequential write of the same number of bytes from memory, fsync at the end
* ``imports``     (peak RSS only) a child that just imports torch and our module: the memory floor of ``ours``

``--cast-dtype bf16`` makes ours convert while writing (the usual case of a bf16 base trained in fp32); raw
then writes the converted size, torch's (which cannot convert) still writes fp32.

Every run is a fresh child process; its peak RSS comes from ``os.wait4``. Prints a markdown table and writes
JSON (``--json``).

    python tools/bench_consolidation.py --work /tmp/bench --size-mb 500 --reps 5
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

METHODS = ("ours", "torch", "torch+fsync", "raw")

_GENERATOR = r'''
import os, sys, torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

out, layers = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo")
cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers,
                  num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=256)
cfg._attn_implementation = "eager"
torch.manual_seed(0)
model = LlamaForCausalLM(cfg).float()
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
for layer in model.model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
dcp.save(get_model_state_dict(model), storage_writer=HuggingFaceStorageWriter(out, save_distributed=True))
from automodel_ckpt.distributed.env import end_process, shutdown_distributed
shutdown_distributed()
end_process(0)
'''


def _layers_for(size_mb: float) -> int:
    hidden, inter, vocab = 1024, 2816, 32000
    per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    fixed = 2 * vocab * hidden + hidden
    return max(1, round((size_mb * 1e6 / 4 - fixed) / per_layer))


def build_shards(work: Path, size_mb: float) -> Path:
    layers = _layers_for(size_mb)
    model_dir = work / f"shards_{layers}layers" / "model"
    if any(model_dir.glob("shard-*.safetensors")):
        return model_dir
    work.mkdir(parents=True, exist_ok=True)
    script = work / "gen_shards.py"
    script.write_text(_GENERATOR, encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(script), str(model_dir), str(layers)]  # fmt: skip
    print(f"building shards ({layers} layers) in {model_dir} ...", flush=True)
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    return model_dir


# ---------------------------------------------------------------------------------------------- children
def child(
    method: str, src: Path, dst: Path, mapping_file: Path, num_threads: int, max_shard_size: int, cast_dtype: str | None
) -> None:
    """One timed run in this (fresh) process; prints ``{"seconds": ...}``."""
    if method == "plan":
        from automodel_ckpt.export import build_plan, parse_cast_dtype

        plan = build_plan(src, parse_cast_dtype(cast_dtype), max_shard_size)
        fqn_to_index = {t.name: k for k, f in enumerate(plan.files, start=1) for t in f.tensors}
        total_bytes = sum(t.nbytes for f in plan.files for t in f.tensors)
        mapping_file.write_text(json.dumps({"fqn_to_index": fqn_to_index, "total_bytes": total_bytes}))
        return
    mapping = json.loads(mapping_file.read_text())
    if method == "imports":
        from automodel_ckpt.export import consolidate  # noqa: F401 - loads the export modules

        seconds = 0.0
    elif method == "ours":
        from automodel_ckpt.export import consolidate

        t0 = time.perf_counter()
        consolidate(src, dst, cast_dtype=cast_dtype, num_threads=num_threads, max_shard_size=max_shard_size,
                    progress=False)  # fmt: skip
        seconds = time.perf_counter() - t0
    elif method in ("torch", "torch+fsync"):
        from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

        t0 = time.perf_counter()
        dst.mkdir()
        consolidate_safetensors_files(str(src), str(dst), mapping["fqn_to_index"], num_threads)
        if method == "torch+fsync":
            for f in sorted(dst.iterdir()):
                fd = os.open(f, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
        seconds = time.perf_counter() - t0
    elif method == "raw":
        block = os.urandom(64 * 2**20)
        nbytes = mapping["total_bytes"]
        t0 = time.perf_counter()
        dst.mkdir()
        fd = os.open(dst / "raw.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        left = nbytes
        while left:
            left -= os.write(fd, memoryview(block)[: min(left, len(block))])
        os.fsync(fd)
        os.close(fd)
        seconds = time.perf_counter() - t0
    else:
        raise SystemExit(f"unknown method {method}")
    print(json.dumps({"seconds": seconds}), flush=True)


def run_child(method: str, src: Path, dst: Path, mapping_file: Path, args: argparse.Namespace, max_shard_size: int) -> dict:
    """Run one timed child and reap it with ``os.wait4`` so its own peak RSS is known."""
    cmd = [sys.executable, __file__, "--child", method, "--src", str(src), "--dst", str(dst), "--mapping",
           str(mapping_file), "--num-threads", str(args.num_threads), "--max-shard-size", str(max_shard_size)]  # fmt: skip
    if args.cast_dtype:
        cmd += ["--cast-dtype", args.cast_dtype]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if proc.returncode:
            raise SystemExit(f"{method} failed:\n{err.read()}")
        result = json.loads(out.read().strip().splitlines()[-1])
    result["peak_rss_mb"] = usage.ru_maxrss / 1024  # Linux reports KiB
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/bench_consolidation"))
    p.add_argument("--size-mb", type=float, default=500)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--num-threads", type=int, default=5)
    p.add_argument("--files", type=int, nargs="+", default=[1, 4], help="output layouts: number of files")
    p.add_argument("--cast-dtype", default=None, help="let ours convert floating tensors (e.g. bf16)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--src", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--dst", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--mapping", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--max-shard-size", type=int, default=5 * 2**30, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args.src, args.dst, args.mapping, args.num_threads, args.max_shard_size, args.cast_dtype)
        return

    src = build_shards(args.work, args.size_mb)
    results: dict = {"size_mb": args.size_mb, "reps": args.reps, "num_threads": args.num_threads, "layouts": []}
    for n_files in args.files:
        total = sum(f.stat().st_size for f in src.glob("*.safetensors"))
        max_shard_size = 5 * 2**30 if n_files == 1 else math.ceil(total / n_files) + 1
        mapping_file = args.work / f"mapping_{n_files}.json"
        # Planned in a child: this parent stays small, since Linux carries a parent's peak RSS into its children.
        plan_cmd = [sys.executable, __file__, "--child", "plan", "--src", str(src), "--mapping", str(mapping_file),
                    "--max-shard-size", str(max_shard_size)] + (["--cast-dtype", args.cast_dtype] if args.cast_dtype else [])  # fmt: skip
        planned = subprocess.run(plan_cmd, capture_output=True, text=True)
        if planned.returncode:
            raise SystemExit(f"planning failed:\n{planned.stderr}")
        mapping = json.loads(mapping_file.read_text())
        total_bytes = mapping["total_bytes"]
        runs: dict[str, list[dict]] = {m: [] for m in METHODS}
        for rep in range(args.reps):
            order = METHODS[rep % len(METHODS) :] + METHODS[: rep % len(METHODS)]
            for method in order:
                dst = args.work / "out"
                shutil.rmtree(dst, ignore_errors=True)
                os.sync()
                runs[method].append(run_child(method, src, dst, mapping_file, args, max_shard_size))
                shutil.rmtree(dst, ignore_errors=True)
        floor = run_child("imports", src, args.work / "unused", mapping_file, args, max_shard_size)["peak_rss_mb"]
        layout_result = {"files": max(mapping["fqn_to_index"].values()), "bytes": total_bytes,
                         "cast_dtype": args.cast_dtype, "imports_rss_mb": floor, "methods": {}}  # fmt: skip
        for method, rs in runs.items():
            secs = [r["seconds"] for r in rs]
            rss = [r["peak_rss_mb"] for r in rs if r["peak_rss_mb"] is not None]
            layout_result["methods"][method] = {
                "median_s": statistics.median(secs),
                "min_s": min(secs),
                "max_s": max(secs),
                "gb_per_s": total_bytes / 1e9 / statistics.median(secs),
                "peak_rss_mb": max(rss) if rss else None,
                "runs_s": secs,
            }
        results["layouts"].append(layout_result)
        _print_table(layout_result)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


def _print_table(res: dict) -> None:
    m = res["methods"]
    ours = m["ours"]["median_s"]
    cast = f", ours casting to {res['cast_dtype']}" if res["cast_dtype"] else ""
    print(f"\n{res['bytes'] / 1e6:.0f} MB into {res['files']} file(s){cast}; imports alone: {res['imports_rss_mb']:.0f} MB RSS\n")
    print("| method | median s | min s | max s | GB/s | peak RSS MB | ours speed-up |")
    print("|---|---|---|---|---|---|---|")
    for name, r in m.items():
        rss = f"{r['peak_rss_mb']:.0f}" if r["peak_rss_mb"] is not None else "n/a"
        print(
            f"| {name} | {r['median_s']:.3f} | {r['min_s']:.3f} | {r['max_s']:.3f} | {r['gb_per_s']:.2f} | {rss} "
            f"| {r['median_s'] / ours:.2f}x |"
        )
    print(
        f"\nours vs torch: {m['torch']['median_s'] / ours:.2f}x faster; "
        f"ours vs raw write: {m['raw']['median_s'] / ours:.2f}x of raw speed"
    )


if __name__ == "__main__":
    main()
