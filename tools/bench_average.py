"""Peak memory of `ckpt-train average` against one checkpoint shard plus the output tensor being written.

Usage: python tools/bench_average.py [--size 26m|120m|tiny] [--nproc 2] [--work DIR] [--json out.json]

Trains a Llama of ``--size`` (``tools/bench_train_peers.llama_config``: random init from one seed, fp32, saved as a
Hugging Face base folder with the embedded tokenizer) for 3 steps on ``--nproc`` processes with a checkpoint every
step (per-rank safetensors shards), then runs ``ckpt-train average --last 3`` as its own process and reads its peak
resident memory (the kernel's ``VmHWM`` for the child, polled until it exits). The same verb on the same kind of
run of a Llama of a few KiB gives the peak of the interpreter and of everything the verb imports: the difference is
what the averaging itself holds. It is set against the largest checkpoint shard file plus the largest output tensor
(what the bound allows) and against the whole model (what averaging state dicts in memory holds, three times over).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
CKPT_TRAIN = [sys.executable, "-m", "automodel_ckpt"]
MiB = 1 << 20

RECIPE = """\
seed: 42
model:
  _target_: automodel_ckpt.models.build.build_causal_lm
  pretrained_model_name_or_path: {base}
  dtype: float32
dataset:
  _target_: automodel_ckpt.data.builtin.builtin_task_dataset
  num_samples: 256
data:
  seq_length: 16
  val_size: 0
step_scheduler:
  global_batch_size: {global_batch}
  local_batch_size: 2
  max_steps: 3
  ckpt_every_steps: 1
  val_every_steps: null
optimizer:
  _target_: torch.optim.AdamW
  lr: 1.0e-4
training:
  progress_bar: false
checkpoint:
  enabled: true
  checkpoint_dir: {run}
  model_save_format: safetensors
  save_consolidated: false
"""


def base_folder(folder: Path, size: str) -> Path:
    """A Llama of ``size`` (random weights, fp32) and the embedded tokenizer, as a Hugging Face folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import bench_train_peers as peers
    from automodel_ckpt.models.tiny import build_tokenizer

    torch.manual_seed(0)
    config = {k: v for k, v in peers.llama_config(size).items() if k != "model_type"}
    LlamaForCausalLM(LlamaConfig(**config)).to(torch.float32).save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    return folder


def train(work: Path, name: str, size: str, nproc: int, env: dict[str, str]) -> Path:
    """The run folder of 3 steps of a ``size`` Llama on ``nproc`` processes, a checkpoint each (kept if there)."""
    run = work / f"{name}-{size}-{nproc}"
    if not (run / "LATEST").exists():
        base = base_folder(work / f"base-{size}", size)
        recipe = work / f"recipe-{name}.yaml"
        recipe.write_text(RECIPE.format(base=base, run=run, global_batch=2 * nproc))
        peak_of([*CKPT_TRAIN, "--nproc-per-node", str(nproc), str(recipe)], env)
    return run


def peak_of(cmd: list[str], env: dict[str, str]) -> tuple[int, float, str]:
    """Peak resident bytes and wall seconds of ``cmd`` run as a child, and its output."""
    with tempfile.TemporaryFile("w+") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
        peak = 0
        while proc.poll() is None:
            try:
                status = Path(f"/proc/{proc.pid}/status").read_text()
                peak = max(peak, int(re.search(r"VmHWM:\s+(\d+)", status).group(1)) * 1024)
            except (OSError, AttributeError):
                pass
            time.sleep(0.01)
        wall = time.perf_counter() - start
        log.seek(0)
        output = log.read()
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{output[-3000:]}")
    return peak, wall, output


def largest_tensor_bytes(folder: Path) -> int:
    """The largest tensor of a folder's safetensors files, from their headers."""
    largest = 0
    for path in folder.glob("*.safetensors"):
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        largest = max([largest] + [end - begin for name, entry in header.items() if name != "__metadata__"
                                   for begin, end in [entry["data_offsets"]]])
    return largest


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="26m", help="tiny, 26m or 120m (default 26m)")
    p.add_argument("--nproc", type=int, default=2, help="processes of the training run (shards per checkpoint)")
    p.add_argument("--work", type=Path, default=None, help="work folder (default: a temporary one)")
    p.add_argument("--json", type=Path, default=None, help="write the numbers here too")
    args = p.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-average-"))
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               HF_DATASETS_CACHE=str(work / "datasets"))
    run, tiny_run = (train(work, name, size, args.nproc, env) for name, size in (("run", args.size), ("tiny", "tiny")))
    baseline, _, _ = peak_of([*CKPT_TRAIN, "average", "--last", "3", str(tiny_run), "--out",
                              str(work / f"tiny-avg-{time.time_ns()}")], env)
    out = work / f"avg-{time.time_ns()}"
    peak, wall, _ = peak_of([*CKPT_TRAIN, "average", "--last", "3", str(run), "--out", str(out)], env)
    newest = sorted(p for p in run.iterdir() if p.name.startswith("epoch_"))[-1] / "model"
    shard = max(p.stat().st_size for p in newest.glob("shard-*.safetensors"))
    model = sum(p.stat().st_size for p in newest.glob("shard-*.safetensors"))
    tensor = largest_tensor_bytes(out)
    held = peak - baseline
    result = {"size": args.size, "nproc": args.nproc, "model_bytes": model, "largest_shard_bytes": shard,
              "largest_output_tensor_bytes": tensor, "peak_rss_bytes": peak, "baseline_rss_bytes": baseline,
              "held_bytes": held, "held_vs_shard_plus_tensor": held / (shard + tensor),
              "held_vs_model": held / model, "seconds": wall}
    print(f"model {model / MiB:.0f} MiB in {args.nproc} shards (largest {shard / MiB:.0f} MiB), largest tensor "
          f"{tensor / MiB:.0f} MiB; average --last 3: peak {peak / MiB:.0f} MiB, interpreter alone "
          f"{baseline / MiB:.0f} MiB, held {held / MiB:.0f} MiB = {result['held_vs_shard_plus_tensor']:.2f}x "
          f"(one shard + the output tensor), {result['held_vs_model']:.2f}x the model; {wall:.1f} s")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
