"""Training step speed of ``ckpt-train`` beside the Hugging Face Trainer and a bare PyTorch loop, same model and rows.

    python tools/bench_train.py [--sizes 26m,120m] [--nprocs 1,2] [--steps 13] [--reps 2]
        [--contenders ours,hf,bare] [--extra="--optimizer.fused false ..."] [--device cpu|cuda] [--dtype fp32|bf16]
        [--peak-tflops 989] [--seq-len 256] [--rows 8] [--work DIR] [--json docs/bench/NAME.json]

Three contenders fine-tune the same Llama (``transformers.LlamaConfig``, random init from one seed, fp32 weights;
``--sizes``: ``tiny`` (a smoke test), ``26m``, ``120m``, ``1b`` (Llama 3.2 1B's shape, for a GPU)) on the same
rows: sequences of 256 tokens (``--seq-len``), every one a label, 8 per process and step (``--rows``), no gradient accumulation, AdamW with the
same hyper-parameters, gradient clipping at 1.0, no validation, no checkpoints:

* ``ours``: ``ckpt-train`` through its CLI, as a user runs it (``tools/bench_train_recipe.py`` only adds each
  rank's peak memory at the end); the rows are a JSONL of 254-character texts that the embedded character-level
  tokenizer turns into exactly 256 tokens (``<s>`` text ``</s>``), so every sequence is full and unpadded. Each
  step's time is the run's own ``step_seconds`` in ``training.jsonl``. ``--extra`` appends CLI overrides (a
  before/after variant of the trainer's defaults);
* ``hf``: ``transformers.Trainer`` with its defaults (``adamw_torch_fused``; DDP under ``torch.distributed.run``
  for several processes), fed the same token ids;
* ``bare``: a plain PyTorch loop with fused AdamW; with several processes, replicated (``bare-ddp``) and sharded
  (``bare-fsdp2``), the faster of the two being the reference "bare best".

The peers live in ``tools/bench_train_peers.py`` and never import this package. Every run is a fresh launch; the
contenders alternate (ours, hf, bare, ours, hf, bare, ...; the first one rotates with each repetition), so a drift
of the machine hits all of them alike. A step is timed from fetching its batch to the end of the optimizer step (the
device synchronised); the reported step time is the median of steps 6..N of every repetition (the first five warm
up; with fewer steps, every step after the first). Reported per contender: that median, the fastest of those steps
(what a quiet moment of a shared machine gives), tokens/s, peak memory per rank (``ru_maxrss``; on CUDA
``torch.cuda.max_memory_allocated`` too), with ``--peak-tflops`` the MFU (``6 × parameters × tokens/s`` over the
peak FLOP/s of the processes' devices), and the speed ratios ours/HF and ours/bare-best (the other's step time over
ours: above 1, ours is faster). On CPU, processes use gloo and
``OMP_NUM_THREADS`` = CPUs / processes for every contender; on CUDA (``--device cuda``), nccl, one GPU per
process, and ``--dtype bf16`` (HF ``bf16=True``, ours ``--distributed.mixed_precision bf16``, bare autocast or
FSDP2's bf16 policy). Prints two markdown tables and writes everything to ``--json`` (alias ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_train_peers as peers  # noqa: E402  (beside this file: the tools are not a package)

REPO = Path(__file__).resolve().parents[1]
TOOLS = Path(__file__).resolve().parent
SEQ, MICRO, SEED, WARMUP = 256, 8, 42, 5
HYPER = {"lr": 3.0e-4, "betas": [0.9, 0.95], "weight_decay": 0.01, "eps": 1.0e-8}
MAX_GRAD_NORM = 1.0
CONTENDERS = ("ours", "hf", "bare")
LABELS = {"ours": "ours (ckpt-train)", "hf": "HF Trainer", "bare": "bare loop", "bare-ddp": "bare loop, DDP",
          "bare-fsdp2": "bare loop, FSDP2"}
MiB = 1 << 20

RECIPE = """\
recipe: {tools}/bench_train_recipe.py:PeakMemoryRecipe
seed: {seed}
model:
  _target_: automodel_ckpt.models.build.build_causal_lm
  config: {config}
  dtype: float32
tokenizer:
  pretrained_model_name_or_path: {work}/tokenizer
dataset:
  _target_: automodel_ckpt.data.files.load_local_dataset
  path: {work}/rows.jsonl
data:
  seq_length: {seq}
  val_size: 0
step_scheduler:
  global_batch_size: {global_batch}
  local_batch_size: {micro}
  max_steps: {steps}
  ckpt_every_steps: null
  val_every_steps: null
optimizer:
  _target_: torch.optim.AdamW
  lr: {lr}
  betas: {betas}
  weight_decay: {weight_decay}
  eps: {eps}
training:
  max_grad_norm: {max_grad_norm}
  progress_bar: false
checkpoint:
  enabled: false
  checkpoint_dir: {run_dir}
"""


def write_rows(work: Path, count: int) -> None:
    """``count`` random rows of ``SEQ`` tokens: ``rows.jsonl`` (text, for ours) and ``rows.npy`` (their token ids,
    as ours tokenizes them: ``<s>``, one id per character, ``</s>``), with the tokenizer folder ours reads."""
    import numpy as np

    from automodel_ckpt.models.tiny import CHARACTERS, build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(work / "tokenizer")
    tokenizer.model_max_length = SEQ  # the saved folder keeps its own; ours cuts at data.seq_length
    rng = np.random.default_rng(SEED)
    letters = np.array(list(CHARACTERS))
    texts = ["".join(letters[rng.integers(0, len(letters), SEQ - 2)]) for _ in range(count)]
    ids = [tokenizer(text).input_ids + [tokenizer.eos_token_id] for text in texts]
    if {len(row) for row in ids} != {SEQ} or any(tokenizer.unk_token_id in row for row in ids):
        raise SystemExit("the embedded tokenizer no longer encodes one token per character; rows would differ")
    with open(work / "rows.jsonl", "w") as f:
        f.writelines(json.dumps({"text": text}) + "\n" for text in texts)
    np.save(work / "rows.npy", np.array(ids, dtype=np.int32))


def _env(nproc: int, work: Path, **extra: str) -> dict:
    threads = str(max(1, (os.cpu_count() or 1) // nproc))
    return dict(os.environ, OMP_NUM_THREADS=threads, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", HF_DATASETS_CACHE=str(work / "datasets"),
                PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
                **extra)


def _launch(cmd: list[str], env: dict, out: Path, cwd: Path) -> str | None:
    """Run ``cmd``, once more if it fails; None on success, else the end of its output (the run then failed)."""
    for attempt in range(2):
        proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
        (out / f"output{attempt or ''}.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode == 0:
            return None
    return f"exit {proc.returncode}: " + (proc.stdout + proc.stderr)[-3000:]


def _ranks(out: Path, nproc: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def run_ours(args: argparse.Namespace, work: Path, size: str, nproc: int, out: Path) -> dict:
    """One ``ckpt-train`` launch; step times from its ``training.jsonl`` (rank 0's)."""
    run_dir = out / "run"
    recipe = out / "recipe.yaml"
    recipe.write_text(RECIPE.format(
        tools=TOOLS, seed=SEED, config=json.dumps(_config(size)), work=work, seq=SEQ, micro=MICRO,
        global_batch=MICRO * nproc, steps=args.steps, max_grad_norm=MAX_GRAD_NORM, run_dir=run_dir,
        **{k: json.dumps(v) for k, v in HYPER.items()}))
    overrides = ["--distributed.mixed_precision", "bf16"] if args.dtype == "bf16" else []
    cmd = [sys.executable, "-m", "automodel_ckpt", "--nproc-per-node", str(nproc), str(recipe), *overrides,
           *args.extra]
    failed = _launch(cmd, _env(nproc, work, BENCH_TRAIN_OUT=str(out)), out, work)
    if failed:
        return {"failed": failed, "command": shlex.join(cmd)}
    log = [json.loads(line) for line in (run_dir / "training.jsonl").read_text().splitlines() if line.strip()]
    if not log or "step_seconds" not in log[0]:
        return {"failed": "training.jsonl has no step_seconds (a ckpt-train older than this tool)"}
    return {"step_seconds": [r["step_seconds"] for r in sorted(log, key=lambda r: r["step"])],
            "ranks": _ranks(out, nproc), "command": shlex.join(cmd)}


def run_peer(args: argparse.Namespace, work: Path, size: str, nproc: int, peer: str, out: Path) -> dict:
    """One launch of a peer (``torch.distributed.run`` for several processes); step times are rank 0's."""
    spec = {"config": _config(size), "seed": SEED, "rows": str(work / "rows.npy"), "steps": args.steps,
            "micro_batch": MICRO, "hyper": HYPER, "max_grad_norm": MAX_GRAD_NORM, "device": args.device,
            "dtype": args.dtype}
    (out / "spec.json").write_text(json.dumps(spec))
    script = [str(TOOLS / "bench_train_peers.py"), peer, "--spec", str(out / "spec.json"), "--out", str(out)]
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)] if nproc > 1 else []
    cmd = [sys.executable, *launcher, *script]
    failed = _launch(cmd, _env(nproc, work), out, work)
    if failed:
        return {"failed": failed, "command": shlex.join(cmd)}
    ranks = _ranks(out, nproc)
    extra = {k: v for k, v in ranks[0].items() if k not in ("rank", "step_seconds", "peak_rss_bytes",
                                                             "cuda_max_allocated_bytes")}
    return {"step_seconds": ranks[0]["step_seconds"], "ranks": ranks, "command": shlex.join(cmd)} | extra


def _config(size: str) -> dict:
    """``size``'s ``LlamaConfig`` arguments, with positions for ``SEQ`` tokens."""
    config = peers.llama_config(size)
    return config | {"max_position_embeddings": max(config["max_position_embeddings"], SEQ)}


def contenders_at(chosen: list[str], nproc: int) -> list[str]:
    """The runs of one (size, processes) group: ``bare`` is one plain process, or DDP and FSDP2 on several."""
    runs = []
    for name in chosen:
        runs += (["bare-ddp", "bare-fsdp2"] if nproc > 1 else ["bare"]) if name == "bare" else [name]
    return runs


def timed_steps(steps: list[float]) -> list[float]:
    """Steps 6..N (the first five warm up); with fewer, every step after the first."""
    skip = WARMUP if len(steps) > WARMUP else min(1, len(steps) - 1)
    return steps[skip:]


def summarize(runs: list[dict], nproc: int, params: int, peak_tflops: float | None) -> dict:
    """The contender's median step time over every repetition's timed steps, tokens/s, peaks and MFU."""
    ok = [r for r in runs if "failed" not in r]
    if not ok:
        return {"failed": runs[-1]["failed"], "runs": runs}
    pooled = [t for r in ok for t in timed_steps(r["step_seconds"])]
    median = statistics.median(pooled)
    tokens = nproc * MICRO * SEQ / median
    result = {"step_seconds_median": median, "fastest_step_seconds": min(pooled),
              "rep_medians": [statistics.median(timed_steps(r["step_seconds"])) for r in ok],
              "tokens_per_s": tokens, "timed_steps": len(pooled),
              "peak_rss_bytes_per_rank": [max(r["ranks"][k]["peak_rss_bytes"] for r in ok) for k in range(nproc)],
              "runs": runs}
    if "cuda_max_allocated_bytes" in ok[0]["ranks"][0]:
        result["cuda_max_allocated_bytes_per_rank"] = [max(r["ranks"][k]["cuda_max_allocated_bytes"] for r in ok)
                                                       for k in range(nproc)]
    if peak_tflops:
        result["mfu"] = 6 * params * tokens / (peak_tflops * 1e12 * nproc)
    return result


def compare(group: dict) -> dict:
    """``bare_best`` and the speed ratios of ours against HF and against the best bare loop (above 1: ours faster)."""
    times = {name: c["step_seconds_median"] for name, c in group.items() if "step_seconds_median" in c}
    bare = {name: t for name, t in times.items() if name.startswith("bare")}
    best = min(bare, key=bare.get) if bare else None
    ours = times.get("ours")
    return {"bare_best": best,
            "ours_speed_over_hf": times["hf"] / ours if ours and "hf" in times else None,
            "ours_speed_over_bare_best": bare[best] / ours if ours and best else None}


def machine(device: str) -> dict:
    """What the numbers depend on: CPUs, memory, kernel, Python, torch and transformers, the GPU, the load."""
    import platform

    import torch
    import transformers

    info: dict = {"cpu_count": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version(),
                  "torch": torch.__version__, "transformers": transformers.__version__}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
        with open("/proc/meminfo") as f:
            info["memory_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except OSError:
        pass
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
    return info


def _num(value: float | None, fmt: str = ".3f", suffix: str = "") -> str:
    return "–" if value is None else f"{value:{fmt}}{suffix}"


def tables(report: dict) -> str:
    cuda, mfu = report["device"] == "cuda", report["peak_tflops"] is not None
    head = ["size", "parameters", "processes", "contender", "median step s", "rep medians s", "fastest step s",
            "tokens/s",
            "peak RSS per rank MiB (max)"]
    head += (["CUDA peak per rank GiB (max)"] if cuda else []) + (["MFU"] if mfu else [])
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ratios = ["| size | processes | ours s | HF s | bare best s | bare best | speed ours/HF | speed ours/bare best |",
              "|---|---|---|---|---|---|---|---|"]
    for group in report["results"]:
        size, nproc = group["size"], group["nproc"]
        params = f"{report['sizes'][size]['parameters'] / 1e6:.1f} M"
        for name, c in group["contenders"].items():
            cells = [size, params, str(nproc), LABELS[name]]
            if "failed" in c:
                rows.append("| " + " | ".join(cells + ["failed"] + [""] * (len(head) - 5)) + " |")
                continue
            cells += [f"{c['step_seconds_median']:.3f}", ", ".join(f"{t:.3f}" for t in c["rep_medians"]),
                      f"{c['fastest_step_seconds']:.3f}", f"{c['tokens_per_s']:.0f}",
                      f"{max(c['peak_rss_bytes_per_rank']) / MiB:.0f}"]
            if cuda:
                cells.append(f"{max(c.get('cuda_max_allocated_bytes_per_rank', [0])) / 2**30:.2f}")
            if mfu:
                cells.append(f"{100 * c['mfu']:.1f}%")
            rows.append("| " + " | ".join(cells) + " |")
        t = {n: c.get("step_seconds_median") for n, c in group["contenders"].items()}
        best = group["bare_best"]
        ratios.append(f"| {size} | {nproc} | {_num(t.get('ours'))} | {_num(t.get('hf'))} | "
                      f"{_num(t.get(best) if best else None)} | {LABELS.get(best, '–')} | "
                      f"{_num(group['ours_speed_over_hf'], '.2f', '×')} | "
                      f"{_num(group['ours_speed_over_bare_best'], '.2f', '×')} |")
    return "\n".join(rows) + "\n\n" + "\n".join(ratios)


def _names(text: str, known: tuple[str, ...] | list[str], flag: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or set(names) - set(known):
        raise SystemExit(f"{flag}: expected some of {', '.join(known)}, got '{text}'")
    return names


def main() -> None:
    global SEQ, MICRO
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="26m,120m", help=f"some of {', '.join(peers.SIZES)} (default 26m,120m)")
    p.add_argument("--nprocs", default="1,2", help="process counts (default 1,2)")
    p.add_argument("--steps", type=int, default=13, help="optimizer steps per run (default 13: steps 6..13 timed)")
    p.add_argument("--reps", type=int, default=2, help="repetitions of every run, interleaved (default 2)")
    p.add_argument("--contenders", default=",".join(CONTENDERS), help="some of ours,hf,bare (default all)")
    p.add_argument("--extra", default="", help="ours' CLI overrides, one string: --extra=\"--key value ...\"")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="bf16: mixed precision (CUDA)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak FLOP/s of one device in TFLOP/s for the MFU column (e.g. 989: H100 bf16 dense)")
    p.add_argument("--seq-len", type=int, default=SEQ, help=f"tokens per row (default {SEQ})")
    p.add_argument("--rows", type=int, default=MICRO, help=f"rows per process and step (default {MICRO})")
    p.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one, removed)")
    p.add_argument("--json", "--out", dest="json", type=Path, default=None, help="write the report here")
    args = p.parse_args()
    SEQ, MICRO = args.seq_len, args.rows
    sizes = _names(args.sizes, list(peers.SIZES), "--sizes")
    chosen = _names(args.contenders, CONTENDERS, "--contenders")
    try:
        nprocs = [int(n) for n in args.nprocs.split(",") if n.strip()]
    except ValueError:
        raise SystemExit(f"--nprocs: expected process counts such as 1,2, got '{args.nprocs}'") from None
    if not nprocs or min(nprocs) < 1 or args.steps < 2 or args.reps < 1:
        raise SystemExit("--nprocs must be >= 1, --steps >= 2 (the first step warms up), --reps >= 1")
    if args.dtype == "bf16" and args.device != "cuda":
        raise SystemExit("--dtype bf16 is for --device cuda (CPU runs are fp32)")
    if args.device == "cuda":
        import torch

        if max(nprocs) > torch.cuda.device_count():
            raise SystemExit(f"--nprocs {args.nprocs}: one GPU per process, and {torch.cuda.device_count()} visible")
    args.extra = shlex.split(args.extra)
    work = (args.work or Path(tempfile.mkdtemp(prefix="bench_train_"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    write_rows(work, args.steps * max(nprocs) * MICRO)
    report = {"machine": machine(args.device), "device": args.device, "dtype": args.dtype, "seq_length": SEQ,
              "micro_batch_per_process": MICRO, "steps": args.steps, "timed_steps": "6..N" if args.steps > WARMUP
              else "2..N", "reps": args.reps, "hyper": HYPER | {"max_grad_norm": MAX_GRAD_NORM}, "extra": args.extra,
              "peak_tflops": args.peak_tflops, "load_average_before": list(os.getloadavg()),
              "sizes": {s: {"config": peers.llama_config(s), "parameters": peers.parameter_count(peers.llama_config(s))}
                        for s in sizes}, "results": []}
    for size in sizes:
        print(f"{size}: {report['sizes'][size]['parameters']:,} parameters", flush=True)
    t_start = time.time()
    for size in sizes:
        for nproc in nprocs:
            names = contenders_at(chosen, nproc)
            runs: dict[str, list[dict]] = {name: [] for name in names}
            for rep in range(args.reps):
                for name in names[rep % len(names):] + names[:rep % len(names)]:  # interleaved, rotating
                    out = work / f"{size}_n{nproc}_{name}_r{rep}"
                    shutil.rmtree(out, ignore_errors=True)
                    out.mkdir(parents=True)
                    t0 = time.time()
                    run = run_ours(args, work, size, nproc, out) if name == "ours" else \
                        run_peer(args, work, size, nproc, name, out)
                    run |= {"rep": rep, "launch_seconds": round(time.time() - t0, 2),
                            "retried": (out / "output1.log").exists()}  # its first launch failed
                    runs[name].append(run)
                    what = "failed" if "failed" in run else \
                        f"median {statistics.median(timed_steps(run['step_seconds'])):.3f} s/step"
                    print(f"  {size} × {nproc} {name} rep {rep}: {what} ({run['launch_seconds']} s)", flush=True)
            params = report["sizes"][size]["parameters"]
            group = {name: summarize(r, nproc, params, args.peak_tflops) for name, r in runs.items()}
            report["results"].append({"size": size, "nproc": nproc, "contenders": group} | compare(group))
    report["load_average_after"] = list(os.getloadavg())
    report["seconds"] = round(time.time() - t_start, 1)
    mach = report["machine"]
    print(f"\n{mach['cpu_count']} CPUs ({mach.get('cpu')}), {mach.get('memory_gib')} GiB"
          + (f", {mach.get('gpu')}" if args.device == "cuda" else "") + f", torch {mach['torch']}, transformers "
          f"{mach['transformers']}; {args.device} {args.dtype}, seq {SEQ}, {MICRO} rows per process and step, "
          f"median of steps {report['timed_steps']} over {args.reps} reps; load average "
          f"{report['load_average_before'][0]:.1f} before, {report['load_average_after'][0]:.1f} after"
          + (f"; ours with {shlex.join(args.extra)}" if args.extra else "") + "\n")
    print(tables(report))
    for group in report["results"]:
        for name, c in group["contenders"].items():
            if "failed" in c:
                print(f"\n{group['size']} × {group['nproc']} {name} failed:\n{c['failed']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
