"""Does the tiny GRPO recipe learn? SFT for 200 steps, then GRPO from that checkpoint, each scored by `ckpt-train eval`.

    python tools/grpo_learns.py [--sft-steps 200] [--grpo-steps N] [--lr LR] [--nproc 2] [--limit 100]
        [--work DIR] [--json FILE] [-- MORE GRPO OVERRIDES]

1. ``recipes/tiny_llama_sft.yaml`` for ``--sft-steps`` steps on ``--nproc`` processes (the embedded tiny Llama,
   built from its config in ``--work``: nothing is downloaded);
2. ``ckpt-train eval <that checkpoint> --tasks addition --limit 100``: greedy exact match on held-out sums;
3. ``recipes/tiny_llama_grpo.yaml`` on ``--nproc`` processes from that checkpoint
   (``checkpoint.restore_from``, ``load_only: [model]``), with the recipe's own defaults unless ``--grpo-steps``,
   ``--lr`` or further overrides after ``--`` say otherwise; timed;
4. the same eval of GRPO's last checkpoint.

Prints and writes (``--json``) both exact matches, the gain, GRPO's minutes, its training reward along the way and
the vector kernels torch ran (``ATEN_CPU_CAPABILITY=avx2 python tools/grpo_learns.py ...``: AVX2's on any machine).
The issue's bar: a gain of at least 0.15, or at least 0.9, in at most 10 minutes of GRPO on 2 CPUs.
Minutes on CPU; a slow check, not a CI test.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def cpu_capability() -> str:
    """The vector kernels torch dispatches to in the runs (``ATEN_CPU_CAPABILITY=avx2`` picks AVX2 on an AVX-512
    machine: the last bits of the runs follow them)."""
    import torch

    return torch.backends.cpu.get_cpu_capability()


def run(work: Path, name: str, *args: str, nproc: int | None = None) -> float:
    """``ckpt-train`` (a recipe on ``nproc`` processes, or a verb); its output in ``work/<name>.log``; seconds."""
    cmd = [sys.executable, "-m", "automodel_ckpt", *(["--nproc-per-node", str(nproc)] if nproc else []), *args]
    threads = max(1, (os.cpu_count() or 1) // (nproc or 1))
    env = dict(os.environ, AUTOMODEL_CKPT_ASSETS=str(work / "assets"), HF_HUB_OFFLINE="1",
               OMP_NUM_THREADS=str(threads))
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    (work / f"{name}.log").write_text(done.stdout + done.stderr)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    return seconds


def last_checkpoint(run_dir: Path) -> Path:
    return max(run_dir.glob("epoch_*_step_*"), key=lambda p: int(p.name.rsplit("_", 1)[1]))


def exact_match(work: Path, checkpoint: Path, limit: int) -> float:
    """``ckpt-train eval --tasks addition``'s exact match of ``checkpoint`` (its first ``limit`` problems)."""
    from automodel_ckpt.ondisk import CheckpointFolder

    run(work, f"eval_{checkpoint.parent.name}", "eval", str(checkpoint), "--tasks", "addition", "--limit",
        str(limit), "--no-track")
    results = json.loads(CheckpointFolder(checkpoint).eval_results("addition").read_text())
    return float(results["results"]["addition"]["exact_match,none"])


def reward_curve(run_dir: Path, points: int = 10) -> list[dict[str, float]]:
    """The training reward (exact answer) averaged over ``points`` stretches of the run."""
    from automodel_ckpt.ondisk import RunFolder

    rows = [json.loads(line) for line in RunFolder(run_dir).training_log.read_text().splitlines()]
    size = max(1, len(rows) // points)
    return [{"steps": f"{part[0]['step']}-{part[-1]['step']}",
             "exact_answer": round(sum(r["reward_exact_answer"] for r in part) / len(part), 3)}
            for part in (rows[i:i + size] for i in range(0, len(rows), size))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sft-steps", type=int, default=200)
    p.add_argument("--grpo-steps", type=int, help="default: the recipe's max_steps")
    p.add_argument("--lr", type=float, help="default: the recipe's")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--limit", type=int, default=100, help="problems of the addition task scored")
    p.add_argument("--work", type=Path)
    p.add_argument("--json", type=Path)
    p.add_argument("overrides", nargs="*", help="more GRPO recipe overrides (after --)")
    args = p.parse_args()
    work = (args.work or Path(tempfile.mkdtemp(prefix="grpo-learns-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    if any((work / name).exists() for name in ("sft", "grpo")):  # its runs would resume from what is there
        p.error(f"--work {work}: holds sft/ or grpo/ of an earlier run; give an empty or new folder")
    sft_seconds = run(work, "sft", str(REPO / "recipes" / "tiny_llama_sft.yaml"), "--training.progress_bar",
                      "false", "--step_scheduler.max_steps", str(args.sft_steps), "--step_scheduler.ckpt_every_steps",
                      str(args.sft_steps), "--checkpoint.checkpoint_dir", "sft", "--data.val_size", "64",
                      nproc=args.nproc)
    sft = last_checkpoint(work / "sft")
    before = exact_match(work, sft, args.limit)
    overrides = ["--checkpoint.restore_from", str(sft), "--checkpoint.load_only", "[model]",
                 "--checkpoint.checkpoint_dir", "grpo", *args.overrides]
    if args.grpo_steps:
        overrides += ["--step_scheduler.max_steps", str(args.grpo_steps)]
    if args.lr is not None:
        overrides += ["--optimizer.lr", str(args.lr)]
    grpo_seconds = run(work, "grpo", str(REPO / "recipes" / "tiny_llama_grpo.yaml"), "--training.progress_bar",
                       "false", *overrides, nproc=args.nproc)
    grpo = last_checkpoint(work / "grpo")
    after = exact_match(work, grpo, args.limit)
    report = {"sft_steps": args.sft_steps, "grpo_checkpoint": grpo.name, "nproc": args.nproc,
              "overrides": overrides[6:], "exact_match_sft": before, "exact_match_grpo": after,
              "gain": round(after - before, 4), "sft_minutes": round(sft_seconds / 60, 2),
              "grpo_minutes": round(grpo_seconds / 60, 2), "reward_curve": reward_curve(work / "grpo"),
              "bar_met": (after - before >= 0.15 or after >= 0.9) and grpo_seconds <= 600,
              "torch_cpu_capability": cpu_capability()}
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
