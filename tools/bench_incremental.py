"""Incremental checkpoints against full ones: bytes written and seconds per save, the tiny VLM with its tower frozen.

    python tools/bench_incremental.py [--model vlm] [--nproc 2] [--steps 6] [--every 1] [--json OUT]
    python tools/bench_incremental.py --model 120m --steps 3     # the 120M Llama, its embeddings frozen

Trains ``recipes/tiny_vlm_sft.yaml`` (its ``model.freeze: [vision_tower]``), or with ``--model tiny|26m|120m`` a
Llama of ``tools/bench_train.py``'s sizes (random weights, tied embeddings, ``model.freeze: [embeddings]``, its
random rows), twice from the same seed, once with ``checkpoint.incremental: false`` and once with ``true``, a
checkpoint every ``--every`` steps, synchronous saves, and reads each save's ``events.jsonl`` record: its size (the manifest's ``total_bytes``), the bytes it wrote (the
size less ``linked_bytes``: files hard-linked from the previous checkpoint) and the seconds the training thread was
blocked. The trainable state (float32 trainable parameters and AdamW's two moments) comes from the start line.

Reported per mode: the per-save numbers, and over the saves after the first the median bytes written, their ratio to
the trainable state and to a full save, and the median seconds. Not a test; the default takes about a minute here.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "tiny_vlm_sft.yaml"
_PARAMS = re.compile(r"Parameters: \S+ \(([\d,]+)\) trainable / \S+ \(([\d,]+)\) frozen")


def _vlm(work: Path, args: argparse.Namespace) -> list[str]:
    return [str(RECIPE), "--dataset.num_samples", "320", "--data.val_size", "16",
            "--step_scheduler.global_batch_size", "8", "--step_scheduler.local_batch_size", str(8 // args.nproc)]


def _llama(work: Path, args: argparse.Namespace) -> list[str]:
    """A recipe of ``tools/bench_train.py`` for the Llama of ``args.model``, its embeddings frozen."""
    sys.path.insert(0, str(REPO / "tools"))
    import bench_train  # noqa: PLC0415  (beside this file: the tools are not a package)

    micro = 2
    if not (work / "rows.jsonl").exists():
        bench_train.write_rows(work, args.steps * micro * args.nproc)
    recipe = work / f"{args.model}.yaml"
    recipe.write_text(bench_train.RECIPE.format(
        tools=bench_train.TOOLS, seed=bench_train.SEED, config=json.dumps(bench_train.peers.llama_config(args.model)),
        work=work, seq=bench_train.SEQ, micro=micro, global_batch=micro * args.nproc, steps=args.steps,
        max_grad_norm=bench_train.MAX_GRAD_NORM, run_dir=work / "unused",
        **{k: json.dumps(v) for k, v in bench_train.HYPER.items()}))
    return [str(recipe), "--checkpoint.enabled", "true", "--model.freeze", "[embeddings]"]


def run(work: Path, name: str, incremental: bool, args: argparse.Namespace) -> dict:
    ckpt_train = Path(sys.executable).parent / "ckpt-train"
    recipe = _vlm(work, args) if args.model == "vlm" else _llama(work, args)
    cmd = [str(ckpt_train), "--nproc-per-node", str(args.nproc), *recipe, "--training.progress_bar", "false",
           "--step_scheduler.val_every_steps", "null",
           "--step_scheduler.max_steps", str(args.steps), "--step_scheduler.ckpt_every_steps", str(args.every),
           "--checkpoint.save_consolidated", "false", "--checkpoint.incremental", str(incremental).lower(),
           "--checkpoint.checkpoint_dir", name]
    env = {**os.environ, "AUTOMODEL_CKPT_ASSETS": str(args.assets or work / "assets"), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "BENCH_TRAIN_OUT": str(work),
           "HF_DATASETS_CACHE": str(work / "datasets"),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"ckpt-train failed:\n{(done.stdout + done.stderr)[-4000:]}")
    trainable, frozen = (int(n.replace(",", "")) for n in _PARAMS.search(done.stdout + done.stderr).groups())
    saves = []
    for line in (work / name / "events.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("event") == "checkpoint":
            saves.append({"step": record["step"], "bytes": record["bytes"],
                          "written_bytes": record.get("written_bytes", record["bytes"]),
                          "seconds": record["blocked_s"]})
    state = trainable * 4 * 3
    later = saves[1:] or saves
    written = statistics.median(s["written_bytes"] for s in later)
    return {"model": args.model, "incremental": incremental, "trainable_params": trainable, "frozen_params": frozen,
            "trainable_state_bytes": state, "saves": saves, "median_written_bytes": written,
            "written_over_trainable_state": round(written / state, 4),
            "written_over_full_save": round(written / statistics.median(s["bytes"] for s in later), 4),
            "median_seconds": round(statistics.median(s["seconds"] for s in later), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vlm", choices=("vlm", "tiny", "26m", "120m"),
                        help="vlm: the tiny VLM, tower frozen (default); a Llama size: its embeddings frozen")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--every", type=int, default=1)
    parser.add_argument("--assets", type=Path, default=None, help="where the tiny VLM base is (made if missing)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-incremental-") as tmp:
        work = Path(tmp)
        report = {"full": run(work, "full", False, args), "incremental": run(work, "incremental", True, args)}
    for mode, r in report.items():
        print(f"{mode:12s} written per save after the first: {r['median_written_bytes'] / 2**20:.2f} MiB = "
              f"{r['written_over_trainable_state']:.4f} x the trainable state, {r['written_over_full_save']:.4f} x "
              f"a full save; {r['median_seconds']:.3f} s blocked per save")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
