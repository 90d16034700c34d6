"""Memory per rank over a whole run from a folder base (setup, first steps, a checkpoint save), at 1, 2 and 4 processes.

    python tools/bench_memory.py [--size 1GB] [--nprocs 1,2,4] [--steps 2] [--optimizers adamw,sgd]
        [--activation-checkpointing both|off|on] [--no-save] [--env KEY=VALUE] [--profile-step N] [--work DIR]
        [--json OUT] [--code DIR]

Writes (once, into ``--work``) a Hugging Face folder base of about ``--size`` bytes of bf16 weights, Llama-shaped
(hidden 1024, GQA, untied embeddings; the number of layers gives the size), then fine-tunes it in fp32, sharded with
FSDP2 (``distributed.dp_shard: full``), with AdamW (or SGD without momentum) for ``--steps`` steps on 1, 2 and 4
processes, saving a checkpoint after the last one.
Each rank records:

* ``idle``: its resident memory when the recipe starts (the process with torch and transformers imported);
* ``setup_peak``: the peak resident memory (``VmHWM``) from there until the model holds its starting weights
  (built on the meta device, sharded, materialised, its slices of the base read); ``post_setup``: what stays then;
* ``steps_peak``: the peak resident memory during the steps (the high-water mark is reset in between);
* ``save_peak``: the peak during the checkpoint save (its background write included);
* ``whole_peak``: the largest of the three, and ``after_setup`` = ``whole_peak - post_setup``;
* on a GPU, the same peaks of device memory (``torch.cuda.max_memory_allocated``);
* ``base_bytes_read``: the bytes of the base's files it read;
* per step: wall and CPU seconds and the pages faulted in (the allocator's cost);
* ``phases``: per step, the level at the start and the peak of each phase (forward, backward, clip grad norm,
  optimizer step, zero_grad and loss, between steps), and ``saves`` the same for the save (rank 0's printed);
* with ``--profile-step N``, ``at_peak``: what step ``N`` held at its peak, by the operation that allocated it
  (``tools/memory_phases.py``; that step's peaks then include the profiler's own memory).

against its share of the training state: ``params`` (fp32 weights / world size) and ``state`` (weights, gradients
and what the optimizer keeps, measured after the first step: 16 bytes per parameter / world size with AdamW, 8 with
SGD). The goals: ``setup_peak - idle <= 1.25 * params + 256 MiB`` and ``whole_peak - idle <= 1.25 * state + 256 MiB``
on every rank; at 4 ranks a setup peak per rank <= 0.35 x the one at 1 rank, and a whole-run peak above idle
<= 0.5 x the one at 1 rank (printed as pass/fail lines). ``--env AUTOMODEL_CKPT_MALLOC=default`` runs with glibc's adaptive thresholds
(before/after). Also reported: the time
from launch to the end of the first step. ``--code DIR`` runs another checkout's package (a before/after
comparison on the same base). When the recipe schema knows ``distributed.activation_checkpointing``,
every world size runs with it off and on (``--activation-checkpointing`` picks one). ``--steps 0`` stops every
run once the model holds its starting weights:
the setup alone, for bases whose training state would not fit the machine on one rank.

Each process also holds memory that does not depend on the model (the interpreter, torch's and the other libraries'
code and data, the tokenised dataset): ``idle`` plus the data build, roughly 450 MiB here. The 4-over-1 ratio of
setup peaks therefore falls with the base's size; the ratio of what the setup adds (``setup_peak - idle``) is the
model's share alone, and is printed beside it. Not a test; the default size takes several minutes on a small
machine.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import automodel_ckpt.recipes.llm_finetune as finetune
from automodel_ckpt.distributed.fsdp import decoder_layers
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
  ckpt_every_steps: {steps}
  val_every_steps: null
optimizer:
{optimizer}
training:
  progress_bar: false
checkpoint:
  enabled: {save}
  checkpoint_dir: {work}/ckpt_{tag}
{distributed}"""
OPTIMIZERS = {  # what each keeps per parameter besides the fp32 weights and gradients
    "adamw": "  _target_: torch.optim.AdamW\n  lr: 1.0e-5",  # two moments
    "sgd": "  _target_: torch.optim.SGD\n  lr: 1.0e-5",  # nothing (no momentum)
}


def _status(key: str) -> int:
    """A ``/proc/self/status`` line in bytes (``VmRSS``, ``VmHWM``)."""
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{key}:\s+(\d+) kB", text, re.M).group(1)) * 1024


def _minor_faults() -> int:
    """Pages this process has faulted in so far (fresh memory touched the first time)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _local(t: torch.Tensor) -> torch.Tensor:
    """A rank's own part of a sharded tensor (a DTensor's local shard), or the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def _memory_phases():
    """``tools/memory_phases.py``, beside this file (the tools are not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("memory_phases", Path(__file__).with_name("memory_phases.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reset_peak() -> None:
    """Start a new resident high-water mark (Linux: ``5`` into ``/proc/self/clear_refs``)."""
    Path("/proc/self/clear_refs").write_text("5")


class MemoryRecipe(FinetuneRecipe):
    """The fine-tuning recipe, recording its resident memory into ``$BENCH_MEMORY_OUT/rank<R>.json``."""

    def setup(self) -> None:
        self._memory = {"idle": _status("VmRSS")}
        self._phase: tuple[str, int, dict] | None = None
        _reset_peak()
        super().setup()
        self._save = self.checkpointer.save  # the checkpointer's step-end call saves through save_checkpoint
        self.checkpointer.save = lambda states, info: self.save_checkpoint(info)
        clip = finetune.clip_grad_norm

        def marked_clip(*args, **kwargs):
            self._enter("clip grad norm")
            return clip(*args, **kwargs)

        finetune.clip_grad_norm = marked_clip  # the recipe's step calls it by this module's name
        self.optimizer.register_step_pre_hook(lambda *_: self._enter("optimizer step"))
        self.optimizer.register_step_post_hook(lambda *_: self._enter("zero_grad, loss"))

    def _enter(self, phase: str, record: dict | None = None) -> None:
        """Close the phase running (its level at the start and its peak, into its record) and start ``phase``."""
        level, peak = _status("VmRSS"), _status("VmHWM")
        if self._phase is not None:
            name, start, into = self._phase
            seen = into.setdefault(name, {"start": start, "peak": 0})
            seen["peak"] = max(seen["peak"], peak)
            record = into if record is None else record
        _reset_peak()
        self._phase = (phase, level, record)

    def token_loss_sum(self, mb):
        if not self.model.training:
            return super().token_loss_sum(mb)
        self._enter("forward")
        summed = super().token_loss_sum(mb)
        self._enter("backward")
        return summed

    def restore_checkpoint(self):
        restored = super().restore_checkpoint()  # the starting weights are in place on return
        self._memory["setup_peak"] = _status("VmHWM")
        starting = getattr(self, "starting_weights", None)  # absent in a checkout that builds the whole model
        self._memory["base_bytes_read"] = starting.record.get("base_bytes_read") if starting else None
        if torch.cuda.is_available():
            self._memory["setup_device_peak"] = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        local = sum(_local(p).numel() for p in self.model.parameters())
        self._memory["local_params"] = local
        self._memory["total_params"] = sum(p.numel() for p in self.model.parameters())
        layers = decoder_layers(self.model)
        block = max((sum(p.numel() for p in layer.parameters()) for layer in layers), default=0)
        self._memory["block_params"] = block  # what one gathered block holds (elements), and the root's own
        self._memory["root_params"] = self._memory["total_params"] - sum(
            p.numel() for layer in layers for p in layer.parameters())
        self._memory["post_setup"] = _status("VmRSS")
        self._memory["phases"] = [{}]  # per step, each phase's level at its start and its peak
        self._enter("between steps (validation, data, logging)", self._memory["phases"][0])
        return restored

    def train(self):
        if os.environ.get("BENCH_MEMORY_SETUP_ONLY") != "1":
            return super().train()
        self._memory["first_step_end"] = time.time()  # the setup's end (and the restore's): no step is taken
        return None

    def train_step(self, micro):
        start, cpu, faults = time.perf_counter(), time.process_time(), _minor_faults()
        self._enter("forward")
        self._memory["phases"].append({})
        self._phase = (self._phase[0], self._phase[1], self._memory["phases"][-1])
        if len(self._memory["phases"]) - 1 == int(os.environ.get("BENCH_MEMORY_PROFILE_STEP", "0")):
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True) as prof:
                out = super().train_step(micro)
                peak = _status("VmHWM")  # the step's last phase ends here: the profile's processing is not the step's
            name, start, into = self._phase
            seen = into.setdefault(name, {"start": start, "peak": 0})
            seen["peak"] = max(seen["peak"], peak)
            self._memory["at_peak"] = _memory_phases().live_at_peak(prof)
            del prof
            gc.collect()
            self._phase = (name, _status("VmRSS"), into)
            _reset_peak()
        else:
            out = super().train_step(micro)
        self._enter("between steps (validation, data, logging)")
        self._memory.setdefault("step_seconds", []).append(time.perf_counter() - start)
        self._memory.setdefault("step_cpu_seconds", []).append(time.process_time() - cpu)  # every thread's
        self._memory.setdefault("step_page_faults", []).append(_minor_faults() - faults)
        if "first_step_end" not in self._memory:
            self._memory["first_step_end"] = time.time()
            self._memory["optimizer_state_bytes"] = sum(
                _local(t).numel() * t.element_size() for state in self.optimizer.state.values()
                for t in state.values() if torch.is_tensor(t) and t.dim() > 0)
        self._memory["steps_peak"] = max(seen["peak"] for step in self._memory["phases"] for seen in step.values())
        if torch.cuda.is_available():
            self._memory["steps_device_peak"] = max(self._memory.get("steps_device_peak", 0),
                                                    torch.cuda.max_memory_allocated())
        return out

    def save_checkpoint(self, info):
        """The save's own peak: the high-water mark is reset before it and read after it (then reset again)."""
        saves = self._memory.setdefault("saves", {})
        self._enter("save")
        self._phase = ("save", self._phase[1], saves)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        saved = self._save(self.checkpointed_state(), info)
        self.finalize_checkpoints()  # an async save's background write is part of its peak
        self._enter("between steps (validation, data, logging)", self._memory["phases"][-1])
        self._memory["save_peak"] = saves["save"]["peak"]
        if torch.cuda.is_available():
            self._memory["save_device_peak"] = torch.cuda.max_memory_allocated()
        return saved

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
    return _knows("activation_checkpointing")


def _knows(key: str) -> bool:
    """Whether the recipe schema has ``distributed.<key>``."""
    import dataclasses

    from automodel_ckpt.config import schema

    return any(f.name == key for f in dataclasses.fields(schema.DistributedConfig))


def _distributed(ac: bool | None) -> str:
    """The recipe's ``distributed:`` section: sharded with FSDP2 (``dp_shard: full``, where the schema has it: the
    goals are those of a sharded run), activation checkpointing as asked."""
    keys = (["  dp_shard: full"] if _knows("dp_shard") else []) + \
        ([] if ac is None else [f"  activation_checkpointing: {str(ac).lower()}"])
    return "distributed:\n" + "".join(k + "\n" for k in keys) if keys else ""


def run_one(work: Path, base: Path, nproc: int, steps: int, ac: bool | None, code: Path = REPO,
            optimizer: str = "adamw", save: bool = True, env: dict[str, str] | None = None,
            profile_step: int = 0, overrides: tuple[str, ...] = (), name: str = "") -> dict:
    """One launch: each rank's record, peaks and step times (``overrides``: ``--key value`` pairs; ``name``: a tag)."""
    tag = f"n{nproc}_{optimizer}" + ("" if ac is None else f"_ac{int(ac)}") + (f"_{name}" if name else "")
    out = work / f"memory_{tag}"
    out.mkdir(exist_ok=True)
    for old in out.glob("rank*.json"):
        old.unlink()
    recipe = work / f"bench_{tag}.yaml"
    recipe.write_text(RECIPE.format(recipe=f"{Path(__file__).resolve()}:MemoryRecipe", base=base, tag=tag,
                                    work=work, steps=max(1, steps), optimizer=OPTIMIZERS[optimizer],
                                    save=str(save and steps > 0).lower(), distributed=_distributed(ac)))
    shutil.rmtree(work / f"ckpt_{tag}", ignore_errors=True)  # a fresh run each time, never a resume
    env = dict(os.environ, BENCH_MEMORY_OUT=str(out), OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // nproc)),
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=f"{code}{os.pathsep}{REPO}",
               BENCH_MEMORY_SETUP_ONLY="1" if steps == 0 else "0", BENCH_MEMORY_PROFILE_STEP=str(profile_step),
               **(env or {}))
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "automodel_ckpt", "--nproc-per-node", str(nproc), str(recipe), *overrides],
                          cwd=work, env=env, capture_output=True, text=True)
    shutil.rmtree(work / f"ckpt_{tag}", ignore_errors=True)
    what = {"nproc": nproc, "optimizer": optimizer, "activation_checkpointing": ac}
    if proc.returncode != 0:
        return what | {"failed": (proc.stdout + proc.stderr)[-2000:]}
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]
    for r in ranks:
        r["params_share"] = r["local_params"] * 4
        # weights and gradients in fp32, and what the optimizer keeps (AdamW: two moments; measured after a step)
        r["state_share"] = 2 * r["params_share"] + r.get("optimizer_state_bytes", 2 * r["params_share"])
        r["setup_over_idle"] = r["setup_peak"] - r["idle"]
        r["setup_goal"] = 1.25 * r["params_share"] + 256 * MiB
        r["steps_over_state"] = (r["steps_peak"] - r["idle"]) / r["state_share"] if "steps_peak" in r else None
        r["whole_peak"] = max(r.get(k, 0) for k in ("setup_peak", "steps_peak", "save_peak"))
        r["whole_over_idle"] = r["whole_peak"] - r["idle"]
        r["whole_goal"] = 1.25 * r["state_share"] + 256 * MiB
        r["after_setup"] = r["whole_peak"] - r["post_setup"]  # what the steps and the save add to the setup's end
    def median_after_first(key: str) -> float | None:  # the first step warms up
        values = [t for r in ranks for t in r.get(key, [])[1:]]
        return statistics.median(values) if values else None

    return what | {"ranks": ranks, "first_step_seconds": max(r["first_step_end"] for r in ranks) - t0,
                   "step_seconds": median_after_first("step_seconds"),
                   "step_cpu_seconds": median_after_first("step_cpu_seconds"),
                   "step_page_faults": median_after_first("step_page_faults"),
                   "setup_peak_max": max(r["setup_peak"] for r in ranks),
                   "setup_added_max": max(r["setup_over_idle"] for r in ranks),
                   "setup_goal_met": all(r["setup_over_idle"] <= r["setup_goal"] for r in ranks),
                   "whole_peak_max": max(r["whole_peak"] for r in ranks),
                   "whole_added_max": max(r["whole_over_idle"] for r in ranks),
                   "whole_goal_met": all(r["whole_over_idle"] <= r["whole_goal"] for r in ranks)}


def _mib(value: int | None) -> str:
    return "–" if value is None else f"{value / MiB:.0f}"


def _num(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


def table(results: list[dict]) -> str:
    rows = ["| ranks | optimizer | act. ckpt | rank | idle MiB | setup peak MiB | (peak-idle)/params | goal met "
            "| steps peak MiB | (peak-idle)/state | base read MiB |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        head = f"| {res['nproc']} | {res['optimizer']} | {res['activation_checkpointing']}"
        if "failed" in res:
            rows.append(f"{head} | failed | | | | | | | |")
            continue
        for i, r in enumerate(res["ranks"]):
            rows.append(
                f"{head} | {i} | {r['idle'] / MiB:.0f} | "
                f"{r['setup_peak'] / MiB:.0f} | {r['setup_over_idle'] / r['params_share']:.2f} | "
                f"{'yes' if r['setup_over_idle'] <= r['setup_goal'] else 'no'} | {_mib(r.get('steps_peak'))} | "
                f"{_num(r['steps_over_state'])} | {(r['base_bytes_read'] or 0) / MiB:.0f} |")
    return "\n".join(rows)


def whole_run_table(results: list[dict]) -> str:
    """Per rank, above the idle process: each phase's peak, the whole run's, its share of the state, the goal."""
    rows = ["| ranks | optimizer | act. ckpt | rank | state share MiB | setup MiB | steps MiB | save MiB "
            "| whole run MiB | whole / state | goal met | step s | step CPU s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        if "failed" in res:
            continue
        for i, r in enumerate(res["ranks"]):
            above = {k: r[k] - r["idle"] if k in r else None for k in ("setup_peak", "steps_peak", "save_peak")}
            rows.append(
                f"| {res['nproc']} | {res['optimizer']} | {res['activation_checkpointing']} | {i} | "
                f"{r['state_share'] / MiB:.0f} | {_mib(above['setup_peak'])} | {_mib(above['steps_peak'])} | "
                f"{_mib(above['save_peak'])} | {r['whole_over_idle'] / MiB:.0f} | "
                f"{r['whole_over_idle'] / r['state_share']:.2f} | "
                f"{'yes' if r['whole_over_idle'] <= r['whole_goal'] else 'no'} | "
                f"{_num(res['step_seconds'])} | {_num(res['step_cpu_seconds'])} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1GB", help="bf16 bytes of the base (default 1GB)")
    parser.add_argument("--nprocs", default="1,2,4", help="process counts to run (default 1,2,4)")
    parser.add_argument("--steps", type=int, default=2, help="steps per run (0: the setup alone)")
    parser.add_argument("--optimizers", default="adamw", help="adamw, sgd or both: adamw,sgd (default adamw)")
    parser.add_argument("--activation-checkpointing", choices=("both", "off", "on"), default="both",
                        help="runs with it off, on or both (default both, where the recipe knows the key)")
    parser.add_argument("--no-save", action="store_true", help="skip the checkpoint save after the last step")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="set in the training processes' environment (e.g. AUTOMODEL_CKPT_MALLOC=default)")
    parser.add_argument("--profile-step", type=int, default=0, metavar="N",
                        help="run step N under torch.profiler and list what rank 0 holds at its peak (slower)")
    parser.add_argument("--work", type=Path, default=Path("bench_memory_work"))
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    parser.add_argument("--code", type=Path, default=REPO,
                        help="the checkout whose automodel_ckpt trains (default: this one; another for comparisons)")
    args = parser.parse_args()
    optimizers = [o.strip().lower() for o in args.optimizers.split(",") if o.strip()]
    if not optimizers or set(optimizers) - set(OPTIMIZERS):
        raise SystemExit(f"--optimizers: expected some of {', '.join(OPTIMIZERS)}, got '{args.optimizers}'")
    env = dict(item.split("=", 1) for item in args.env if "=" in item)
    args.work.mkdir(parents=True, exist_ok=True)
    config = llama_config(parse_size(args.size))
    base = write_base(args.work / f"base_{config['num_hidden_layers']}l", config)
    acs: list[bool | None] = [None]
    if knows_activation_checkpointing():
        acs = {"both": [False, True], "off": [False], "on": [True]}[args.activation_checkpointing]
    results = [run_one(args.work.resolve(), base.resolve(), int(n), args.steps, ac, args.code.resolve(),
                       optimizer=opt, save=not args.no_save, env=env, profile_step=args.profile_step)
               for opt in optimizers for n in args.nprocs.split(",") for ac in acs]
    report = {"size_bytes": sum(f.stat().st_size for f in base.glob("*.safetensors")), "config": config,
              "runs": results, "environment": env, "activation_checkpointing": "measured" if acs != [None] else
              "skipped: distributed.activation_checkpointing is not a key of this version"}
    for opt in optimizers:
        ok = {r["nproc"]: r for r in results
              if "failed" not in r and not r["activation_checkpointing"] and r["optimizer"] == opt}
        if 1 in ok and 4 in ok:
            suffix = "" if opt == optimizers[0] else f"_{opt}"
            report["setup_peak_4_over_1" + suffix] = ok[4]["setup_peak_max"] / ok[1]["setup_peak_max"]
            report["setup_added_4_over_1" + suffix] = ok[4]["setup_added_max"] / ok[1]["setup_added_max"]
            report["whole_added_4_over_1" + suffix] = ok[4]["whole_added_max"] / ok[1]["whole_added_max"]
    print(f"base: {report['size_bytes'] / MiB:.0f} MiB bf16, {config['num_hidden_layers']} layers")
    print(table(results))
    if args.steps:
        print("\nthe whole run, above the idle process:")
        print(whole_run_table(results))
    for r in results:
        if "failed" in r:
            print(f"{r['nproc']} ranks ({r['optimizer']}) failed:\n{r['failed']}")
        else:
            what = "first step" if args.steps else "setup done"
            print(f"{r['nproc']} ranks ({r['optimizer']}, activation checkpointing {r['activation_checkpointing']}): "
                  f"{what} {r['first_step_seconds']:.1f} s after launch")
    if "setup_peak_4_over_1" in report:
        print(f"setup peak per rank, 4 ranks over 1 rank: {report['setup_peak_4_over_1']:.2f} (goal <= 0.35); "
              f"what the setup adds to an idle process, 4 ranks over 1 rank: {report['setup_added_4_over_1']:.2f}")
    if args.steps:
        print("\nrank 0 in each phase of the steps and the save, above the idle process:")
        print(_memory_phases().phases_table(results))
        for r in results:
            at_peak = r.get("ranks", [{}])[0].get("at_peak")
            if at_peak:
                print(f"\n{r['nproc']} ranks, {r['optimizer']}: step {args.profile_step} on rank 0 peaks "
                      f"{at_peak['peak_mib']:.0f} MiB above its start, {at_peak['at']:.0%} through it, in "
                      f"{at_peak['peak_owner']}; live then (owner, MiB, blocks):")
                print("\n".join(f"  {name}: {mib} MiB in {n}" for name, mib, n in at_peak["live"]))
        print("\nthe whole run's goals:")
        print("\n".join(_memory_phases().goal_lines(results, report)))
    if acs == [None]:
        print(report["activation_checkpointing"])
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
