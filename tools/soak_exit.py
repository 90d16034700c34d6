"""Many short 2-process runs beside a CPU hog: every finished run must exit 0 (no abort at process exit).

A finished job that aborts while its processes exit is reported as failed, and a scheduler requeues it. Such
aborts hide in teardown races that CPU contention widens, so this runs the embedded recipe for a few steps, with
a checkpoint and the inline export, ``--runs`` times while busy processes keep every core loaded, and reports
each exit code.

    .venv/bin/python tools/soak_exit.py --runs 30            # exit status 1 if any run failed
    .venv/bin/python tools/soak_exit.py --runs 5 --async     # async checkpoints
    .venv/bin/python tools/soak_exit.py --runs 10 --consolidate   # then the last checkpoint's consolidate.sh, 2 ranks
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "tiny_llama_sft.yaml"


def _spin(stop: Any) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10_000))


def run_once(index: int, work: Path, assets: Path, extra: list[str], consolidate: bool) -> tuple[int, str]:
    """One short 2-process run (and its 2-process export); returns its exit code and the tail of its output."""
    ckpt_train = str(Path(sys.executable).parent / "ckpt-train")
    run_dir = work / f"run{index}"
    cmd = [ckpt_train, "--nproc-per-node", "2", str(RECIPE), "--step_scheduler.max_steps", "4",
           "--step_scheduler.ckpt_every_steps", "2", "--checkpoint.checkpoint_dir", str(run_dir), *extra]
    env = dict(os.environ, AUTOMODEL_CKPT_ASSETS=str(assets), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=900)
    if consolidate and proc.returncode == 0:
        from automodel_ckpt.ondisk import RunFolder

        script = RunFolder(run_dir).checkpoint(RunFolder.latest).model.consolidate_script
        proc = subprocess.run(["bash", str(script)], cwd=work, env=dict(env, NPROC_PER_NODE="2"),
                              capture_output=True, text=True, timeout=900)
    shutil.rmtree(run_dir, ignore_errors=True)
    return proc.returncode, (proc.stdout + proc.stderr)[-3000:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30, help="number of runs (default 30)")
    parser.add_argument("--hogs", type=int, default=os.cpu_count() or 2,
                        help="busy processes beside the runs (default: one per core)")
    parser.add_argument("--async", dest="is_async", action="store_true", help="async checkpoints")
    parser.add_argument("--consolidate", action="store_true",
                        help="after each run, export its last checkpoint with consolidate.sh on 2 processes")
    parser.add_argument("--work", type=Path, default=None, help="folder for the runs (default: a temporary one)")
    args = parser.parse_args(argv)
    extra = ["--checkpoint.is_async", "true"] if args.is_async else []
    work = Path(args.work or tempfile.mkdtemp(prefix="soak-exit-"))
    work.mkdir(parents=True, exist_ok=True)
    assets = work / "assets"
    from automodel_ckpt.models.tiny import ensure_tiny_base

    ensure_tiny_base(assets / "tiny_llama_base")
    stop = multiprocessing.Event()
    hogs = [multiprocessing.Process(target=_spin, args=(stop,), daemon=True) for _ in range(args.hogs)]
    for hog in hogs:
        hog.start()
    failures = []
    try:
        for i in range(1, args.runs + 1):
            code, tail = run_once(i, work, assets, extra, args.consolidate)
            print(f"run {i}/{args.runs}: exit {code}", flush=True)
            if code != 0:
                failures.append((i, code, tail))
    finally:
        stop.set()
        for hog in hogs:
            hog.join()
    for i, code, tail in failures:
        print(f"--- run {i} (exit {code}), end of its output:\n{tail}", file=sys.stderr)
    print(f"soak: {args.runs - len(failures)} of {args.runs} runs exited 0 beside {args.hogs} busy processes")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
