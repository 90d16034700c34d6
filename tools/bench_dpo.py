"""Preference tuning's step time and peak memory: full fine-tune, LoRA and precomputed reference, beside LoRA SFT.

    python tools/bench_dpo.py [--size 120m] [--nprocs 1,2] [--steps 8] [--pairs 2] [--device cpu|cuda]
        [--variants full,lora,precomputed,lora_sft] [--threads N] [--work DIR] [--json docs/bench/dpo.json]

Every variant trains the same Llama (``tools/bench_train_peers.llama_config``: ``tiny``, ``26m``, ``120m``, ``1b``;
and ``200m``, the issue's base size: 120m's vocabulary, 15 layers of width 1024; random init from one seed, fp32)
through ``ckpt-train`` as a user runs it (``tools/bench_dpo_recipe.py`` only adds each rank's peak memory), on the
same pairs: a 128-character prompt and two 126-character responses, so each side is exactly 256 tokens with the
embedded character-level tokenizer; ``--pairs`` pairs per process and step (2 x that many sequences a forward), no
accumulation, no validation, no checkpoints:

* ``full``: full fine-tune, the live reference a frozen copy sharded like the policy;
* ``lora``: LoRA (rank 16 on every projection), the reference the policy with its adapters disabled;
* ``precomputed``: full fine-tune with ``dpo.precompute_ref_log_probs`` (computed once before step 1, not timed;
  no reference in memory);
* ``lora_precomputed``: LoRA with ``dpo.precompute_ref_log_probs`` (the adapters-disabled forward done once);
* ``lora_sft``: LoRA SFT (the fine-tune recipe) on 2 x ``--pairs`` sequences a step: the same rows a forward.

Reported per variant and process count: the median step time of steps 3..N (``step_seconds`` in training.jsonl),
the fastest step, and each rank's peak memory (``ru_maxrss``; on CUDA ``max_memory_allocated`` too), with the
ratios the issue asks for: LoRA DPO's peak over LoRA SFT's, precomputed over live-reference step time (full
fine-tune and LoRA).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_train_peers as peers  # noqa: E402

TOOLS = Path(__file__).resolve().parent
REPO = TOOLS.parent
PROMPT, RESPONSE, SEED = 128, 126, 42
VARIANTS = ("full", "lora", "precomputed", "lora_precomputed", "lora_sft")
MiB = 1 << 20
SIZES = peers.SIZES | {"200m": {"vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816,
                                "num_hidden_layers": 15, "num_attention_heads": 16, "num_key_value_heads": 4}}
LORA = {"rank": 16, "alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                     "down_proj"]}


def llama_config(size: str) -> dict:
    return peers.COMMON | SIZES[size]


def write_pairs(work: Path, count: int) -> None:
    """``pairs.jsonl`` (prompt, chosen, rejected) and ``rows.jsonl`` (prompt, completion: the chosen ones) of
    random characters, with the tokenizer folder both read."""
    import random

    from automodel_ckpt.models.tiny import CHARACTERS, build_tokenizer

    build_tokenizer().save_pretrained(work / "tokenizer")
    rng = random.Random(SEED)
    text = lambda n: "".join(rng.choice(CHARACTERS) for _ in range(n))  # noqa: E731
    pairs = [{"prompt": text(PROMPT), "chosen": text(RESPONSE), "rejected": text(RESPONSE)} for _ in range(count)]
    with open(work / "pairs.jsonl", "w") as f:
        f.writelines(json.dumps(p) + "\n" for p in pairs)
    with open(work / "rows.jsonl", "w") as f:
        f.writelines(json.dumps({"prompt": p["prompt"], "completion": p["chosen"]}) + "\n" for p in pairs)


def recipe(work: Path, out: Path, size: str, variant: str, nproc: int, pairs: int, steps: int) -> dict:
    sft = variant == "lora_sft"
    rows = 2 * pairs if sft else pairs
    cfg = {
        "recipe": f"{TOOLS}/bench_{'train' if sft else 'dpo'}_recipe.py:PeakMemory{'' if sft else 'DPO'}Recipe",
        "seed": SEED,
        "model": {"_target_": "automodel_ckpt.models.build.build_causal_lm", "config": llama_config(size),
                  "dtype": "float32"},
        "tokenizer": {"pretrained_model_name_or_path": str(work / "tokenizer")},
        "dataset": {"_target_": "automodel_ckpt.data.files.load_local_dataset",
                    "path": str(work / ("rows.jsonl" if sft else "pairs.jsonl"))},
        "data": {"seq_length": 1 + PROMPT + RESPONSE + 1, "val_size": 0},
        "step_scheduler": {"global_batch_size": rows * nproc, "local_batch_size": rows, "max_steps": steps},
        "optimizer": {"_target_": "torch.optim.AdamW", "lr": 1e-5},
        "training": {"progress_bar": False},
        "checkpoint": {"enabled": False, "checkpoint_dir": str(out / "run")},
    }
    if variant.startswith("lora"):
        cfg["peft"] = dict(LORA)
    if not sft:
        cfg["dpo"] = {"precompute_ref_log_probs": variant.endswith("precomputed")}
    return cfg


def run(args: argparse.Namespace, work: Path, variant: str, nproc: int) -> dict:
    import yaml

    out = work / f"{variant}_{nproc}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "recipe.yaml").write_text(yaml.safe_dump(recipe(work, out, args.size, variant, nproc, args.pairs,
                                                           args.steps)))
    threads = str(args.threads or max(1, (os.cpu_count() or 1) // nproc)) if args.device == "cpu" else "1"
    env = dict(os.environ, OMP_NUM_THREADS=threads, HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(work / "datasets"),
               TOKENIZERS_PARALLELISM="false", BENCH_TRAIN_OUT=str(out),
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    cmd = [sys.executable, "-m", "automodel_ckpt", "--nproc-per-node", str(nproc), str(out / "recipe.yaml")]
    proc = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True)
    (out / "output.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        return {"failed": (proc.stdout + proc.stderr)[-2000:], "command": shlex.join(cmd)}
    log = [json.loads(line) for line in (out / "run" / "training.jsonl").read_text().splitlines() if line.strip()]
    steps = [r["step_seconds"] for r in sorted(log, key=lambda r: r["step"])]
    timed = steps[2:] or steps[1:] or steps
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]
    return {"median_step_s": statistics.median(timed), "fastest_step_s": min(timed),
            "peak_rss_mib": max(r["peak_rss_bytes"] for r in ranks) / MiB,
            "cuda_max_allocated_mib": max((r.get("cuda_max_allocated_bytes", 0) for r in ranks), default=0) / MiB,
            "command": shlex.join(cmd)}


def table(report: dict) -> str:
    lines = ["| variant | processes | median step (s) | fastest (s) | peak memory per rank (MiB) |",
             "|---|---|---|---|---|"]
    for key, r in report["runs"].items():
        variant, nproc = key.rsplit("_", 1)
        if "failed" in r:
            lines.append(f"| {variant} | {nproc} | failed | | |")
            continue
        memory = r["cuda_max_allocated_mib"] or r["peak_rss_mib"]
        lines.append(f"| {variant} | {nproc} | {r['median_step_s']:.3f} | {r['fastest_step_s']:.3f} | {memory:.0f} |")
    for name, value in report["ratios"].items():
        lines.append(f"\n{name}: {value:.2f}")
    return "\n".join(lines)


def ratios(runs: dict, nprocs: list[int]) -> dict:
    out = {}
    for n in nprocs:
        full, lora, pre, lora_pre, sft = (runs.get(f"{v}_{n}", {}) for v in VARIANTS)
        mem = "cuda_max_allocated_mib" if sft.get("cuda_max_allocated_mib") else "peak_rss_mib"
        if lora.get(mem) and sft.get(mem):
            out[f"LoRA DPO peak / LoRA SFT peak, {n} process(es)"] = lora[mem] / sft[mem]
        if pre.get("median_step_s") and full.get("median_step_s"):
            out[f"precomputed / live reference step time, {n} process(es)"] = \
                pre["median_step_s"] / full["median_step_s"]
        if lora_pre.get("median_step_s") and lora.get("median_step_s"):
            out[f"LoRA precomputed / LoRA live reference step time, {n} process(es)"] = \
                lora_pre["median_step_s"] / lora["median_step_s"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="120m", choices=sorted(SIZES))
    p.add_argument("--nprocs", default="1,2")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--pairs", type=int, default=2, help="pairs per process and step")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--threads", type=int, help="OMP threads per process on CPU (default: CPUs / processes; on a "
                   "shared machine 1, since oversubscribed OpenMP threads spin: 4x slower steps measured here)")
    p.add_argument("--work", type=Path)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    nprocs = [int(n) for n in args.nprocs.split(",")]
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        p.error(f"--variants: unknown {', '.join(unknown)} (known: {', '.join(VARIANTS)})")
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-dpo-"))
    work.mkdir(parents=True, exist_ok=True)
    write_pairs(work, max(64, 2 * args.pairs * max(nprocs) * (args.steps + 1)))
    runs = {f"{v}_{n}": run(args, work, v, n) for n in nprocs for v in variants}
    report = {"size": args.size, "parameters": peers.parameter_count(llama_config(args.size)),
              "pairs_per_process": args.pairs, "tokens_per_sequence": 1 + PROMPT + RESPONSE + 1,
              "device": args.device, "runs": runs, "ratios": ratios(runs, nprocs)}
    print(table(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
