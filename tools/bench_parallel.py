"""Step time and peak memory per rank of ``ckpt-train`` runs under each parallel layout: dp, pp, pp × dp, pp × tp, ep.

    python tools/bench_parallel.py [--size 300MB] [--steps 4] [--layouts dp1,dp4,pp4,...] [--json OUT] [--work DIR]

Writes (once, into ``--work``) a Hugging Face folder base of about ``--size`` bytes of bf16 weights, Llama-shaped
(``tools/bench_memory.py``'s, its layers rounded to a multiple of 4 so that 4 stages cut it evenly), and for the
expert-parallel rows a Qwen3-MoE base of about the same size (8 experts, 2 per token). Each layout fine-tunes it in
fp32 with AdamW for ``--steps`` steps, checkpointing off, global batch 8 (each data-parallel rank one local batch of
``8 / dp`` rows; a pipeline cuts it into ``pp`` microbatches), through ``bench_memory.MemoryRecipe``, which records
every rank's resident memory when the recipe starts (``idle``), its high-water mark (``VmHWM``) over the whole run
and each step's wall time. Layouts (``--layouts``, comma-separated; default all but ``pp2``):

* ``dp1``: 1 process, the memory reference; ``dp4``: FSDP2 over 4 processes;
* ``pp4``, ``pp4-gpipe``, ``pp4-interleaved``: 4 pipeline ranks under ``1f1b``, under ``gpipe`` (the bubble: same
  stages, same microbatches, two schedules) and under ``interleaved_1f1b`` with 2 stages per rank (8 stages); ``pp2dp2``: 2 stages, each sharded over 2 ranks; ``pp2tp2``: 2 stages, each
  split by tensor parallelism over 2 ranks; ``pp2``: 2 stages on 2 processes (a small check);
* ``moe-dp4``: the MoE base under FSDP2 on 4 processes, the reference of ``ep2dp2``: the experts spread over
  groups of 2 of the 4 data-parallel ranks (``dp 4 × ep 2``, two copies of each rank's experts, sharded by FSDP2).

Prints one table: layout, processes, step time (median over the ranks of the steps after the first) and its CPU
seconds per rank (every thread's; where processes outnumber the cores, the wall time is their sum), peak resident
memory per rank above its idle process (the largest rank's), and its ratio to the reference (``dp1``; ``moe-dp4``
for the MoE rows); then the step times of ``pp4``'s schedules and a pass/fail line for the goal
``pp4 <= 0.35 x dp1``. Not a test: at the default size on a small machine it takes several minutes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_memory  # noqa: E402  (beside this file: the tools are not a package)

MiB = bench_memory.MiB
GLOBAL_BATCH = 8
EXPERTS, EXPERTS_PER_TOKEN = 8, 2
#: layout -> (label, base, processes, pp, tp, ep, pipeline schedule)
LAYOUTS = {
    "dp1": ("dp 1", "dense", 1, 1, 1, 1, None),
    "dp4": ("dp 4", "dense", 4, 1, 1, 1, None),
    "pp4": ("pp 4 (1f1b)", "dense", 4, 4, 1, 1, "1f1b"),
    "pp4-gpipe": ("pp 4 (gpipe)", "dense", 4, 4, 1, 1, "gpipe"),
    "pp4-interleaved": ("pp 4 (interleaved_1f1b, 2 stages per rank)", "dense", 4, 4, 1, 1, "interleaved_1f1b"),
    "pp2dp2": ("dp 2 × pp 2", "dense", 4, 2, 1, 1, "1f1b"),
    "pp2tp2": ("pp 2 × tp 2", "dense", 4, 2, 2, 1, "1f1b"),
    "pp2": ("pp 2", "dense", 2, 2, 1, 1, "1f1b"),
    "moe-dp4": ("dp 4, MoE", "moe", 4, 1, 1, 1, None),
    "ep2dp2": ("dp 4 × ep 2, MoE", "moe", 4, 1, 1, 2, None),
}
DEFAULT = [name for name in LAYOUTS if name != "pp2"]
REFERENCE = {"dense": "dp1", "moe": "moe-dp4"}


def dense_config(size: int) -> dict:
    """``bench_memory``'s Llama config of about ``size`` bf16 bytes, with a multiple of 4 layers (at least 4)."""
    config = bench_memory.llama_config(size)
    config["num_hidden_layers"] = max(4, 4 * round(config["num_hidden_layers"] / 4))
    return config


def moe_config(size: int) -> dict:
    """A Qwen3-MoE config of about ``size`` bf16 bytes: Llama's attention, 8 experts of a quarter of its MLP."""
    hidden, heads, kv = bench_memory.HIDDEN, bench_memory.HEADS, bench_memory.KV_HEADS
    head, expert = hidden // heads, bench_memory.INTERMEDIATE // 4
    per_layer = (2 * hidden * hidden + 2 * hidden * kv * head + 3 * EXPERTS * hidden * expert + EXPERTS * hidden
                 + 2 * hidden + 2 * head)
    layers = max(1, round((size / 2 - 2 * bench_memory.VOCAB * hidden - hidden) / per_layer))
    return {"model_type": "qwen3_moe", "vocab_size": bench_memory.VOCAB, "hidden_size": hidden,
            "intermediate_size": bench_memory.INTERMEDIATE, "moe_intermediate_size": expert, "num_experts": EXPERTS,
            "num_experts_per_tok": EXPERTS_PER_TOKEN, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv, "head_dim": head, "max_position_embeddings": 64,
            "tie_word_embeddings": False, "dtype": "bfloat16"}


def overrides(layout: str) -> tuple[str, ...]:
    """The ``ckpt-train`` keys of a layout: its sizes, its schedule, and the local batch of its data-parallel ranks."""
    _, _, nproc, pp, tp, ep, schedule = LAYOUTS[layout]
    dp = nproc // (pp * tp)
    keys = ["--step_scheduler.global_batch_size", str(GLOBAL_BATCH),
            "--step_scheduler.local_batch_size", str(GLOBAL_BATCH // dp)]
    for key, value in (("pp_size", pp), ("tp_size", tp), ("ep_size", ep)):
        if value > 1:
            keys += [f"--distributed.{key}", str(value)]
    if schedule and pp > 1:
        keys += ["--distributed.pp_schedule", schedule]
    return tuple(keys)


def run_layout(work: Path, bases: dict[str, Path], layout: str, steps: int) -> dict:
    """One launch of ``layout`` through ``bench_memory.run_one``, checkpointing off."""
    label, base, nproc, *_ = LAYOUTS[layout]
    run = bench_memory.run_one(work, bases[base], nproc, steps, None, save=False, overrides=overrides(layout),
                               name=layout.replace("-", "_"))
    return run | {"layout": layout, "label": label, "base": base}


def add_ratios(runs: dict[str, dict]) -> None:
    """Each run's peak above idle over its reference's (``dp1``, or ``moe-dp4`` for the MoE base)."""
    for run in runs.values():
        ref = runs.get(REFERENCE[run["base"]])
        if "failed" not in run and ref and "failed" not in ref:
            run["peak_ratio"] = run["whole_added_max"] / ref["whole_added_max"]


def table(runs: dict[str, dict]) -> str:
    rows = ["| layout | processes | step s (median) | step CPU s per rank | peak per rank above idle, MiB (max over "
            "ranks) | × reference | reference |", "|---|---|---|---|---|---|---|"]
    for run in runs.values():
        head = f"| {run['label']} | {run['nproc']}"
        if "failed" in run:
            rows.append(f"{head} | failed | | | | |")
            continue
        ratio = run.get("peak_ratio")
        seconds = f"{bench_memory._num(run['step_seconds'])} | {bench_memory._num(run['step_cpu_seconds'])}"
        rows.append(f"{head} | {seconds} | {run['whole_added_max'] / MiB:.0f} | "
                    f"{'–' if ratio is None else f'{ratio:.3f}'} | {LAYOUTS[REFERENCE[run['base']]][0]} |")
    return "\n".join(rows)


def summary(runs: dict[str, dict]) -> list[str]:
    """The schedules' line (pp 4 under 1f1b, gpipe and interleaved_1f1b) and the memory goal's pass/fail line."""
    ok = {name: run for name, run in runs.items() if "failed" not in run}
    lines = []
    held = [(LAYOUTS[layout][6], ok[layout]) for layout in ("pp4", "pp4-gpipe", "pp4-interleaved") if layout in ok]
    if len(held) > 1:
        first = held[0][1]["step_seconds"]
        times = [f"{name} {run['step_seconds']:.2f} s" + (f" ({run['step_seconds'] / first:.2f}×)" if i else "")
                 for i, (name, run) in enumerate(held)]
        peaks = [f"{name} {run['whole_added_max'] / MiB:.0f} MiB" for name, run in held]
        lines.append(f"pp 4 step time: {', '.join(times)}; peak above idle: {', '.join(peaks)}")
    if "pp4" in ok and "peak_ratio" in ok["pp4"]:
        ratio = ok["pp4"]["peak_ratio"]
        lines.append(f"goal pp 4 peak per rank above idle <= 0.35 x dp 1's: {ratio:.3f} "
                     f"{'PASS' if ratio <= 0.35 else 'FAIL'}")
    for run in runs.values():
        if "failed" in run:
            lines.append(f"{run['label']} failed:\n{run['failed']}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="300MB", help="bf16 bytes of each base (default 300MB)")
    parser.add_argument("--steps", type=int, default=4, help="steps per run, at least 2 (default 4)")
    parser.add_argument("--layouts", default=",".join(DEFAULT), help=f"some of {', '.join(LAYOUTS)}")
    parser.add_argument("--work", type=Path, default=Path("bench_parallel_work"))
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    args = parser.parse_args()
    layouts = [name.strip() for name in args.layouts.split(",") if name.strip()]
    if not layouts or set(layouts) - set(LAYOUTS):
        raise SystemExit(f"--layouts: expected some of {', '.join(LAYOUTS)}, got '{args.layouts}'")
    if args.steps < 2:
        raise SystemExit(f"--steps: the step time is the median of the steps after the first; got {args.steps}, "
                         "use 2 or more")
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    size = bench_memory.parse_size(args.size)
    configs = {"dense": dense_config(size), "moe": moe_config(size)}
    bases = {kind: bench_memory.write_base(work / f"base_{kind}_{c['num_hidden_layers']}l", c).resolve()
             for kind, c in configs.items() if any(LAYOUTS[name][1] == kind for name in layouts)}
    runs = {name: run_layout(work, bases, name, args.steps) for name in layouts}
    add_ratios(runs)
    sizes = {kind: sum(f.stat().st_size for f in base.glob("*.safetensors")) for kind, base in bases.items()}
    for kind, base in bases.items():
        print(f"{kind} base: {sizes[kind] / MiB:.0f} MiB bf16, {configs[kind]['num_hidden_layers']} layers")
    print(table(runs))
    lines = summary(runs)
    print("\n".join(lines))
    if args.json:
        report = {"size_bytes": sizes, "configs": {k: configs[k] for k in bases}, "steps": args.steps,
                  "runs": runs, "summary": lines}
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
