"""Launch to first step: a resumed run against a fresh start from the same base (``bench_checkpoint.py --only resume``).

A Llama base model of the benchmark's size (fp32 safetensors, with the embedded tokenizer) is written once; the
built-in addition recipe (``recipes/tiny_llama_sft.yaml``) starts from it with ``--nproc`` ranks:

* ``fresh``:  ``ckpt-train`` in an empty checkpoint folder, timed from launch to the first step's line in
  ``training.jsonl``;
* ``exec``: the fresh start with ``--start-method exec`` (workers as new interpreters, not forked);
* ``resume``: ``ckpt-train`` in a copy of a run folder that holds a checkpoint of step 1 (model, AdamW state,
  scheduler, RNG, data position), timed from launch to the first resumed step's line (step 2).

The page cache is dropped before each launch where permitted. Each launch's output lines are timestamped as they
arrive, which splits the time into phases: ``start`` (launch to the data report: interpreters, imports, model
build from the base, sharding, data), ``probe`` (to "Loading checkpoint": the catalog, the checkpoint's manifest,
headers and indexes), and ``first step`` (the state load, the data position restored, and the step itself).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "tiny_llama_sft.yaml"
CKPT_TRAIN = str(Path(sys.executable).parent / "ckpt-train")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def make_base(folder: Path, config) -> Path:
    """An HF Llama folder of ``config`` (fp32 weights, seeded) with the embedded base's tokenizer."""
    import torch
    from transformers import LlamaForCausalLM

    from automodel_ckpt.models.tiny import ensure_tiny_base

    tiny = ensure_tiny_base(folder.parent / "tiny_llama_base")
    torch.manual_seed(0)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(config, key, json.loads((tiny / "config.json").read_text())[key])
    config.max_position_embeddings = 64
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tiny / name).exists():
            shutil.copy(tiny / name, folder / name)
    return folder


def _args(base: Path, run: Path, fmt: str, max_steps: int) -> list[str]:
    return [str(RECIPE), "--training.progress_bar", "false",
            "--model.pretrained_model_name_or_path", str(base),
            "--dataset.num_samples", "2000", "--data.val_size", "0",
            "--step_scheduler.global_batch_size", "8", "--step_scheduler.local_batch_size", "4",
            "--step_scheduler.max_steps", str(max_steps), "--step_scheduler.ckpt_every_steps", "1",
            "--step_scheduler.val_every_steps", "1000",
            "--checkpoint.checkpoint_dir", str(run), "--checkpoint.model_save_format", fmt,
            "--checkpoint.save_consolidated", "false"]


def launch(base: Path, run: Path, fmt: str, nproc: int, step: int, start_method: str = "fork") -> dict:
    """Run ``ckpt-train`` until it ends; seconds from launch to its data report, to "Loading checkpoint" and to
    the line of ``step`` in ``training.jsonl``."""
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc)), "HF_HUB_OFFLINE": "1",
           "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}
    cmd = [CKPT_TRAIN, "--nproc-per-node", str(nproc), "--start-method", start_method, *_args(base, run, fmt, step)]
    marks: dict = {}
    log = run / "training.jsonl"
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=run.parent)
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            now = time.perf_counter() - t0
            if line.startswith("data:"):
                marks.setdefault("data", now)
            elif line.startswith("Loading checkpoint from"):
                marks.setdefault("loading", now)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    while "first_step" not in marks and proc.poll() is None:
        if log.exists():
            for line in log.read_text().splitlines():
                if line.strip() and json.loads(line).get("step") == step:
                    marks["first_step"] = time.perf_counter() - t0
        time.sleep(0.02)  # polling for the line (the run's own pace is what is measured)
    proc.wait()
    reader.join()
    if proc.returncode or "first_step" not in marks:
        raise SystemExit(f"ckpt-train failed ({proc.returncode}): {' '.join(cmd)}\n{''.join(lines)[-4000:]}")
    return marks


def measure(work: Path, config, nproc: int, reps: int, fmt: str, drop_caches) -> dict:
    """``reps`` interleaved fresh starts and resumes; per kind, the median of each phase mark."""
    work.mkdir(parents=True, exist_ok=True)
    base = make_base(work / "base", config)
    seed = work / "seed"
    launch(base, seed, fmt, nproc, 1)  # a checkpoint of step 1 to resume from
    runs: dict[str, list[dict]] = {"fresh": [], "resume": [], "exec": []}
    for rep in range(reps):
        for kind in (("fresh", "resume", "exec") if rep % 2 == 0 else ("exec", "resume", "fresh")):
            run = work / f"{kind}-{rep}"
            if kind == "resume":
                shutil.copytree(seed, run, symlinks=True)
            else:
                run.mkdir()
            drop_caches()
            marks = launch(base, run, fmt, nproc, 2 if kind == "resume" else 1, "exec" if kind == "exec" else "fork")
            runs[kind].append(marks)
            print(f"  rep {rep + 1} {kind}: first step after {marks['first_step']:.2f} s", flush=True)
            shutil.rmtree(run, ignore_errors=True)
    out: dict = {"format": fmt}
    for kind, rs in runs.items():
        out[kind] = {k: statistics.median(r[k] for r in rs) for k in rs[0]} | {"runs": rs}
    out["ratio"] = out["resume"]["first_step"] / out["fresh"]["first_step"]
    out["fork_over_exec"] = out["fresh"]["first_step"] / out["exec"]["first_step"]
    shutil.rmtree(work, ignore_errors=True)
    return out


def print_rows(res: dict) -> None:
    """The resume rows of the benchmark's report."""
    fresh, resume = res["fresh"], res["resume"]

    def phases(r: dict) -> str:
        data, loading = r.get("data"), r.get("loading")
        probe = f"{loading - data:.2f}" if loading and data else "–"
        step = r["first_step"] - (loading or data or 0)
        return f"{data:.2f} | {probe} | {step:.2f}" if data else "– | – | –"

    print(f"\nLaunch to first step ({res['format']} checkpoint, medians in s; start: launch to the data report — "
          "interpreters, imports, model build from the base, data; probe: catalog and checkpoint check; first step: "
          "state load, data position, the step)\n")
    print("| run | launch → first step | start | probe | first step | vs fresh |")
    print("|---|---|---|---|---|---|")
    print(f"| fresh start from the base | {fresh['first_step']:.2f} | {phases(fresh)} | 1.00× |")
    print(f"| **resume** from step 1 | {resume['first_step']:.2f} | {phases(resume)} | **{res['ratio']:.2f}×** |")
    if "exec" in res:
        print(f"| fresh start, workers as new interpreters (`--start-method exec`) | {res['exec']['first_step']:.2f} | "
              f"{phases(res['exec'])} | {1 / res['fork_over_exec']:.2f}× |")
    print("\nvs fresh: resume's time over the fresh start's (goal: <= 1.2×); the fresh start forks its workers from "
          "the launcher (`--start-method fork`, the default).")
