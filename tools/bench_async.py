"""Async vs sync checkpointing: how long training stalls per checkpoint, and how much slower steps get meanwhile.

    python tools/bench_async.py [--nproc 2] [--steps 12] [--every 4] [--layers 12] [--out DIR]

Trains a Llama-style model sized for about 125M parameters (fp32 weights + AdamW moments: about 1.5 GB of
state) on the embedded tiny task, twice: ``checkpoint.is_async: false`` then ``true``, checkpointing every
``--every`` steps. Every rank records (rank 0's numbers are reported, they are the slowest-to-return rank's
collective view anyway):

* ``stall``: wall time of each save call on the training thread. Sync: the whole save. Async: completing the
  previous save (if its files were written already this is the fsync/manifest/publish of a finished
  checkpoint), reserving, copying the state to host memory, starting the background write and the small files.
* ``background``: from the save call's return until the background write finished (async only).
* step time of the steps that ran while a background write was in progress, against the other steps.
* ``final``: the last save plus ``finalize`` (async: the process cannot exit before the checkpoint is complete).

Prints a Markdown table (docs/async.md has the one measured on the machine it names) and writes the raw numbers
to ``DIR/bench_async.json``. Not a test: it takes minutes and writes several GB.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from automodel_ckpt.recipes.llm_finetune import FinetuneRecipe

REPO = Path(__file__).resolve().parents[1]

RECIPE = """\
recipe: {recipe}
seed: 42
model:
  _target_: automodel_ckpt.models.build.build_causal_lm
  pretrained_model_name_or_path: {base}
  dtype: float32
  config:
    model_type: llama
    vocab_size: 64
    hidden_size: 768
    intermediate_size: 3456
    num_hidden_layers: {layers}
    num_attention_heads: 12
    num_key_value_heads: 12
    max_position_embeddings: 64
    tie_word_embeddings: false
dataset:
  _target_: automodel_ckpt.data.builtin.builtin_task_dataset
  num_samples: 512
data:
  seq_length: 16
  val_size: 8
step_scheduler:
  global_batch_size: {gbs}
  local_batch_size: 2
  max_steps: {steps}
  ckpt_every_steps: {every}
optimizer:
  _target_: torch.optim.AdamW
  lr: 1.0e-4
training:
  progress_bar: false
checkpoint:
  checkpoint_dir: {ckpt_dir}
  model_save_format: safetensors
  save_consolidated: false
  is_async: {is_async}
"""


class BenchRecipe(FinetuneRecipe):
    """The fine-tuning recipe, timing its steps and saves into ``$BENCH_ASYNC_OUT`` (one JSON per rank)."""

    def setup(self) -> None:
        super().setup()
        self._timings: dict = {"steps": [], "saves": []}

    def _background_busy(self) -> bool:
        pending = getattr(self.checkpointer, "_pending", None)
        return pending is not None and any(not f.done() for f, _ in pending.writes)

    def train_step(self, micro):
        busy = self._background_busy()
        t0 = time.perf_counter()
        out = super().train_step(micro)
        self._timings["steps"].append({"seconds": time.perf_counter() - t0,
                                       "background": busy or self._background_busy()})
        return out

    def save_checkpoint(self, info):
        t0 = time.perf_counter()
        path = super().save_checkpoint(info)
        returned = time.perf_counter()
        record = {"step": info.step, "stall": returned - t0, "background": None, "final": info.is_final,
                  "phases": dict(self.checkpointer.last_save_seconds),
                  "complete": dict(self.checkpointer.last_complete_seconds)}
        pending = getattr(self.checkpointer, "_pending", None)
        if pending is not None and pending.writes:
            last = pending.writes[-1][0]
            last.add_done_callback(lambda _f, r=record: r.__setitem__("background", time.perf_counter() - returned))
        self._timings["saves"].append(record)
        return path

    def finalize_checkpoints(self):
        t0 = time.perf_counter()
        out = super().finalize_checkpoints()
        if self._timings["saves"]:
            last = self._timings["saves"][-1]
            last["finalize"] = time.perf_counter() - t0
        return out

    def run(self) -> None:
        super().run()
        out = os.environ.get("BENCH_ASYNC_OUT")
        if out:
            Path(out, f"rank{self.env.rank}.json").write_text(json.dumps(self._timings, indent=1))


def _state_bytes(layers: int) -> int:
    h, i, v = 768, 3456, 64
    params = layers * (4 * h * h + 3 * h * i + 2 * h) + 2 * v * h + h
    return params * 4 * 3  # fp32 weights + two AdamW moments


def run_mode(work: Path, base: Path, args, is_async: bool) -> dict:
    mode = "async" if is_async else "sync"
    recipe_file = work / f"bench_{mode}.yaml"
    recipe_file.write_text(RECIPE.format(
        recipe=f"{Path(__file__).resolve()}:BenchRecipe", base=base, layers=args.layers, steps=args.steps,
        every=args.every, gbs=2 * args.nproc, ckpt_dir=work / f"ckpt_{mode}", is_async=str(is_async).lower()))
    out = work / f"timings_{mode}"
    out.mkdir(exist_ok=True)
    env = dict(os.environ, BENCH_ASYNC_OUT=str(out), OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // args.nproc)),
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "automodel_ckpt", "--nproc-per-node", str(args.nproc), str(recipe_file)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{mode} run failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    timings = json.loads((out / "rank0.json").read_text())
    timings["wall"] = wall
    size = sum(f.stat().st_size for f in (work / f"ckpt_{mode}").glob("epoch_*/**/*") if f.is_file())
    timings["checkpoint_bytes"] = size // max(1, len(list((work / f"ckpt_{mode}").glob("epoch_*"))))
    shutil.rmtree(work / f"ckpt_{mode}", ignore_errors=True)
    return timings


def table(sync: dict, asyn: dict) -> str:
    rows = ["| checkpoint | sync save (s) | async stall (s) | of which: copy of the state (s) | stall / sync save "
            "| background write (s) |",
            "|---|---|---|---|---|---|"]
    for i, (s, a) in enumerate(zip(sync["saves"], asyn["saves"])):
        if s["final"]:
            continue
        bg = f"{a['background']:.2f}" if a.get("background") is not None else "-"
        copy = a.get("phases", {}).get("copy_state")
        note = " (first: allocates the host copy)" if i == 0 else ""
        rows.append(f"| step {s['step']}{note} | {s['stall']:.2f} | {a['stall']:.2f} | "
                    f"{f'{copy:.2f}' if copy is not None else '-'} | {100 * a['stall'] / s['stall']:.1f}% | {bg} |")
    fs, fa = sync["saves"][-1], asyn["saves"][-1]
    rows.append(f"| step {fs['step']} (final, until complete) | {fs['stall'] + fs.get('finalize', 0):.2f} | "
                f"{fa['stall'] + fa.get('finalize', 0):.2f} | - | - | - |")
    idle = [s["seconds"] for s in asyn["steps"] if not s["background"]][1:]  # the first step warms up
    busy = [s["seconds"] for s in asyn["steps"] if s["background"]]
    sync_steps = [s["seconds"] for s in sync["steps"]][1:]
    lines = ["\n".join(rows), ""]
    if idle and busy:
        slow = statistics.median(busy) / statistics.median(idle) - 1
        lines.append(f"Step time (median): {statistics.median(idle):.2f} s without a background write, "
                     f"{statistics.median(busy):.2f} s while one runs ({100 * slow:+.0f}%, {len(busy)} steps); "
                     f"sync run: {statistics.median(sync_steps):.2f} s.")
    lines.append(f"Whole run: sync {sync['wall']:.0f} s, async {asyn['wall']:.0f} s.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--out", type=Path, default=None, help="folder for the run (default: a temporary one)")
    args = parser.parse_args()
    work = args.out or Path(tempfile.mkdtemp(prefix="bench_async_"))
    work.mkdir(parents=True, exist_ok=True)
    from automodel_ckpt.models.tiny import ensure_tiny_base

    base = ensure_tiny_base(work / "tiny_llama_base")  # its tokenizer; the model is built from the config above
    import torch

    print(f"state: {_state_bytes(args.layers) / 1e9:.2f} GB (weights + AdamW), {args.nproc} process(es), "
          f"{args.steps} steps, a checkpoint every {args.every}; torch {torch.__version__}, "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs", flush=True)
    results = {}
    for is_async in (False, True):
        results["async" if is_async else "sync"] = run_mode(work, base, args, is_async)
        print(f"{'async' if is_async else 'sync'} run done ({results['async' if is_async else 'sync']['wall']:.0f} s)",
              flush=True)
    print(f"checkpoint size: {results['sync']['checkpoint_bytes'] / 1e9:.2f} GB")
    print(table(results["sync"], results["async"]))
    (work / "bench_async.json").write_text(json.dumps(results, indent=1))
    print(f"raw numbers: {work / 'bench_async.json'}")


if __name__ == "__main__":
    main()
