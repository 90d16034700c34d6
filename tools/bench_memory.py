"""Memory per rank while a run starts from a folder base and takes its first steps, at 1, 2 and 4 processes.

    python tools/bench_memory.py [--size 1GB] [--nprocs 1,2,4] [--steps 2] [--work DIR] [--json OUT] [--code DIR]

Writes (once, into ``--work``) a Hugging Face folder base of about ``--size`` bytes of bf16 weights, Llama-shaped
(hidden 1024, GQA, untied embeddings; the number of layers gives the size), then fine-tunes it in fp32 with AdamW
for ``--steps`` steps on 1, 2 and 4 processes. Each rank records:

* ``idle``: its resident memory when the recipe starts (the process with torch and transformers imported);
* ``setup_peak``: the peak resident memory (``VmHWM``) from there until the model holds its starting weights
  (built on the meta device, sharded, materialised, its slices of the base read);
* ``steps_peak``: the peak resident memory during the first steps (the high-water mark is reset in between);
* on a GPU, the same two peaks of device memory (``torch.cuda.max_memory_allocated``);
* ``base_bytes_read``: the bytes of the base's files it read;

against its share of the training state: ``params`` (fp32 weights / world size) and ``state`` (weights, gradients
and both AdamW moments: 16 bytes per parameter / world size). The goals: ``setup_peak - idle <= 1.25 * params +
256 MiB`` on every rank, and at 4 ranks a setup peak per rank <= 0.35 x the one at 1 rank. Also reported: the time
from launch to the end of the first step. ``--code DIR`` runs another checkout's package (a before/after
comparison on the same base). When the recipe schema knows ``distributed.activation_checkpointing``,
every world size runs with it off and on. ``--steps 0`` stops every run once the model holds its starting weights:
the setup alone, for bases whose training state would not fit the machine on one rank.

Each process also holds memory that does not depend on the model (the interpreter, torch's and the other libraries'
code and data, the tokenised dataset): ``idle`` plus the data build, roughly 450 MiB here. The 4-over-1 ratio of
setup peaks therefore falls with the base's size; the ratio of what the setup adds (``setup_peak - idle``) is the
model's share alone, and is printed beside it. Not a test; the default size takes several minutes on a small
machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from automodel_ckpt.recipes.llm_finetune import FinetuneRecipe

REPO = Path(__file__).resolve().parents[1]
HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, VOCAB = 1024, 2816, 16, 4, 8192
MiB = 1 << 20

RECIPE = """\
recipe: {recipe}
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
  val_size: 8
step_scheduler:
  global_batch_size: 4
  local_batch_size: 1
  max_steps: {steps}
  val_every_steps: null
optimizer:
  _target_: torch.optim.AdamW
  lr: 1.0e-5
training:
  progress_bar: false
checkpoint:
  enabled: false
  checkpoint_dir: {work}/ckpt
{distributed}"""


def _status(key: str) -> int:
    """A ``/proc/self/status`` line in bytes (``VmRSS``, ``VmHWM``)."""
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{key}:\s+(\d+) kB", text, re.M).group(1)) * 1024


def _reset_peak() -> None:
    """Start a new resident high-water mark (Linux: ``5`` into ``/proc/self/clear_refs``)."""
    Path("/proc/self/clear_refs").write_text("5")


class MemoryRecipe(FinetuneRecipe):
    """The fine-tuning recipe, recording its resident memory into ``$BENCH_MEMORY_OUT/rank<R>.json``."""

    def setup(self) -> None:
        self._memory = {"idle": _status("VmRSS")}
        _reset_peak()
        super().setup()

    def restore_checkpoint(self):
        restored = super().restore_checkpoint()  # the starting weights are in place on return
        self._memory["setup_peak"] = _status("VmHWM")
        starting = getattr(self, "starting_weights", None)  # absent in a checkout that builds the whole model
        self._memory["base_bytes_read"] = starting.record.get("base_bytes_read") if starting else None
        if torch.cuda.is_available():
            self._memory["setup_device_peak"] = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in self.model.parameters())
        self._memory["local_params"] = local
        self._memory["total_params"] = sum(p.numel() for p in self.model.parameters())
        _reset_peak()
        return restored

    def _train(self) -> None:
        if os.environ.get("BENCH_MEMORY_SETUP_ONLY") != "1":
            return super()._train()
        self.setup()
        self.restore_checkpoint()
        self._memory["first_step_end"] = time.time()  # the setup's end: no step is taken

    def train_step(self, micro):
        out = super().train_step(micro)
        if "first_step_end" not in self._memory:
            self._memory["first_step_end"] = time.time()
        self._memory["steps_peak"] = _status("VmHWM")
        if torch.cuda.is_available():
            self._memory["steps_device_peak"] = torch.cuda.max_memory_allocated()
        return out

    def run(self) -> None:
        super().run()
        Path(os.environ["BENCH_MEMORY_OUT"], f"rank{self.env.rank}.json").write_text(json.dumps(self._memory))


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?)i?B?\s*", text, re.I)
    if not m:
        raise SystemExit(f"--size: expected e.g. 1GB or 300MB, got '{text}'")
    return int(float(m.group(1)) * 1024 ** "BKMGT".index((m.group(2) or "B").upper()))


def llama_config(size: int) -> dict:
    """A Llama config whose bf16 weights take about ``size`` bytes (at least one layer)."""
    head = HIDDEN // HEADS
    per_layer = (2 * HIDDEN * HIDDEN + 2 * HIDDEN * KV_HEADS * head + 3 * HIDDEN * INTERMEDIATE + 2 * HIDDEN)
    layers = max(1, round((size / 2 - 2 * VOCAB * HIDDEN - HIDDEN) / per_layer))
    return {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE,
            "num_hidden_layers": layers, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
            "max_position_embeddings": 64, "tie_word_embeddings": False, "dtype": "bfloat16"}


def write_base(folder: Path, config: dict, shard_bytes: int = 512 * MiB) -> Path:
    """A folder base (bf16 safetensors files + index, config, tokenizer), written one file at a time."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from automodel_ckpt.models.tiny import build_tokenizer

    if (folder / "config.json").is_file():
        return folder
    tmp = folder.with_name(folder.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    kwargs = dict(config)
    hf_config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(hf_config).state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    groups: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        n = math.prod(shape) * 2
        if groups[-1] and size + n > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    weight_map = {}
    for i, names in enumerate(groups, 1):
        file = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        tensors = {n: (torch.ones(shapes[n]) if n.endswith("norm.weight") else
                       torch.randn(shapes[n], generator=gen) * 0.02).to(torch.bfloat16) for n in names}
        save_file(tensors, str(tmp / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in names})
        del tensors
    total = sum(math.prod(s) * 2 for s in shapes.values())
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}, indent=1))
    hf_config.save_pretrained(tmp)
    build_tokenizer().save_pretrained(tmp)
    tmp.rename(folder)
    return folder


def knows_activation_checkpointing() -> bool:
    import dataclasses

    from automodel_ckpt.config import schema

    return any(f.name == "activation_checkpointing" for f in dataclasses.fields(schema.DistributedConfig))


def run_one(work: Path, base: Path, nproc: int, steps: int, ac: bool | None, code: Path = REPO) -> dict:
    tag = f"n{nproc}" + ("" if ac is None else f"_ac{int(ac)}")
    out = work / f"memory_{tag}"
    out.mkdir(exist_ok=True)
    recipe = work / f"bench_{tag}.yaml"
    recipe.write_text(RECIPE.format(recipe=f"{Path(__file__).resolve()}:MemoryRecipe", base=base,
                                    work=work, steps=max(1, steps), distributed="" if ac is None else
                                    f"distributed:\n  activation_checkpointing: {str(ac).lower()}\n"))
    env = dict(os.environ, BENCH_MEMORY_OUT=str(out), OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // nproc)),
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=f"{code}{os.pathsep}{REPO}",
               BENCH_MEMORY_SETUP_ONLY="1" if steps == 0 else "0")
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "automodel_ckpt", "--nproc-per-node", str(nproc), str(recipe)],
                          cwd=work, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"nproc": nproc, "activation_checkpointing": ac, "failed": (proc.stdout + proc.stderr)[-2000:]}
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]
    for r in ranks:
        r["params_share"] = r["local_params"] * 4
        r["state_share"] = r["local_params"] * 16
        r["setup_over_idle"] = r["setup_peak"] - r["idle"]
        r["setup_goal"] = 1.25 * r["params_share"] + 256 * MiB
        r["steps_over_state"] = (r["steps_peak"] - r["idle"]) / r["state_share"] if "steps_peak" in r else None
    return {"nproc": nproc, "activation_checkpointing": ac, "ranks": ranks,
            "first_step_seconds": max(r["first_step_end"] for r in ranks) - t0,
            "setup_peak_max": max(r["setup_peak"] for r in ranks),
            "setup_added_max": max(r["setup_over_idle"] for r in ranks),
            "setup_goal_met": all(r["setup_over_idle"] <= r["setup_goal"] for r in ranks)}


def _mib(value: int | None) -> str:
    return "–" if value is None else f"{value / MiB:.0f}"


def _num(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


def table(results: list[dict]) -> str:
    rows = ["| ranks | act. ckpt | rank | idle MiB | setup peak MiB | (peak-idle)/params | goal met | steps peak MiB "
            "| (peak-idle)/state | base read MiB |", "|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        if "failed" in res:
            rows.append(f"| {res['nproc']} | {res['activation_checkpointing']} | failed | | | | | | | |")
            continue
        for i, r in enumerate(res["ranks"]):
            rows.append(
                f"| {res['nproc']} | {res['activation_checkpointing']} | {i} | {r['idle'] / MiB:.0f} | "
                f"{r['setup_peak'] / MiB:.0f} | {r['setup_over_idle'] / r['params_share']:.2f} | "
                f"{'yes' if r['setup_over_idle'] <= r['setup_goal'] else 'no'} | {_mib(r.get('steps_peak'))} | "
                f"{_num(r['steps_over_state'])} | {(r['base_bytes_read'] or 0) / MiB:.0f} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1GB", help="bf16 bytes of the base (default 1GB)")
    parser.add_argument("--nprocs", default="1,2,4", help="process counts to run (default 1,2,4)")
    parser.add_argument("--steps", type=int, default=2, help="steps per run (0: the setup alone)")
    parser.add_argument("--work", type=Path, default=Path("bench_memory_work"))
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    parser.add_argument("--code", type=Path, default=REPO,
                        help="the checkout whose automodel_ckpt trains (default: this one; another for comparisons)")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    config = llama_config(parse_size(args.size))
    base = write_base(args.work / f"base_{config['num_hidden_layers']}l", config)
    acs: list[bool | None] = [False, True] if knows_activation_checkpointing() else [None]
    results = [run_one(args.work.resolve(), base.resolve(), int(n), args.steps, ac, args.code.resolve())
               for n in args.nprocs.split(",") for ac in acs]
    ok = {r["nproc"]: r for r in results if "failed" not in r and not r["activation_checkpointing"]}
    report = {"size_bytes": sum(f.stat().st_size for f in base.glob("*.safetensors")), "config": config,
              "runs": results, "activation_checkpointing": "measured" if acs != [None] else
              "skipped: distributed.activation_checkpointing is not a key of this version"}
    if 1 in ok and 4 in ok:
        report["setup_peak_4_over_1"] = ok[4]["setup_peak_max"] / ok[1]["setup_peak_max"]
        report["setup_added_4_over_1"] = ok[4]["setup_added_max"] / ok[1]["setup_added_max"]
    print(f"base: {report['size_bytes'] / MiB:.0f} MiB bf16, {config['num_hidden_layers']} layers")
    print(table(results))
    for r in results:
        if "failed" in r:
            print(f"{r['nproc']} ranks failed:\n{r['failed']}")
        else:
            what = "first step" if args.steps else "setup done"
            print(f"{r['nproc']} ranks (activation checkpointing {r['activation_checkpointing']}): {what} "
                  f"{r['first_step_seconds']:.1f} s after launch")
    if "setup_peak_4_over_1" in report:
        print(f"setup peak per rank, 4 ranks over 1 rank: {report['setup_peak_4_over_1']:.2f} (goal <= 0.35); "
              f"what the setup adds to an idle process, 4 ranks over 1 rank: {report['setup_added_4_over_1']:.2f}")
    if acs == [None]:
        print(report["activation_checkpointing"])
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
