"""Async checkpoints against sync ones and against none: stall per checkpoint, and whole-run throughput.

    python tools/bench_async.py [--nproc 2] [--steps 201] [--every 20] [--layers 2] [--reps 2] [--modes ...] [--json OUT]
    python tools/bench_async.py --small --json OUT      # a tiny model and few steps: checks the tool, not speed
    python tools/bench_async.py --tracking tensorboard  # the same with experiment tracking on (docs/tracking.md)

Trains a Llama-style model (hidden 768; ``--layers`` sets its size; fp32 weights + AdamW moments) on the embedded
tiny task once per mode, checkpointing every ``--every`` steps:

* ``none``: no checkpoints (the throughput reference);
* ``sync``: ``checkpoint.is_async: false``;
* ``async``: ``checkpoint.is_async: true`` (this project's overlapped snapshot);
* ``dcp_thread`` / ``dcp_process``: ``torch.distributed.checkpoint.async_save`` of the same model and optimizer
  state, in its thread and process modes (each waits for the previous one before starting the next);
* ``torch_stager``: the same through ``async_save`` with torch's own staging, a kept ``DefaultStager`` copying in
  the background behind the same optimizer-step fence as ``async`` (pinned memory on CUDA; bench_async_torch.py).
  ``--stager torch|ours|both`` runs it, ``async`` or both against ``none`` and ``sync``, for the table below.

Rank 0 records, per checkpoint, the ``stall``: the wall time the training thread lost to it (the save call, plus
for ``async`` the time the next ``optimizer.step()`` waited at the fence for the background copy), and per run the
throughput from the end of the first step to the end of the run (last checkpoint complete), and the CPU seconds
the process used meanwhile (training and background threads together). With ``--reps N`` the modes run N times,
interleaved (none, sync, async, ..., none, sync, ...), so that a drift of the machine's load hits every mode alike.
Reported as ratios:

* ``stall_over_sync``: median async stall of the steady-state checkpoints (not the first, not the final one)
  over the median sync save of the same checkpoints, over every repetition;
* ``stall_parts``: what that stall is made of (medians, seconds): ``snapshot`` (the state dicts collected, small
  tensors and buffers copied), ``small_files`` (per-rank and global states serialized, metadata built),
  ``hand_off`` (to the background thread), ``complete_previous``, ``reserve``, ``other`` (the rest of the call)
  and ``fence`` (the next optimizer step's wait for the background copy);
* ``run_overhead_<mode>``: the fraction of tokens/s lost against the ``none`` runs (median steps/s over the
  repetitions; ``run_overhead_async``, ...);
* ``run_overhead_spread_<mode>``: the smallest and largest loss of one repetition (against the median ``none``);
* ``steady_overhead_<mode>`` (and ``_spread_``): the same over whole save cycles only, from the end of step
  ``--every`` (its save next) to the end of the last multiple of ``--every`` before the last step: every cycle has
  ``--every`` steps and one checkpoint, and the run's final save (one step after the last cycle's) and the wait for
  it at the end, which a long run spreads over many cycles, are left out;
* ``within_run_cost_<mode>`` (and ``_spread_``): the same cycles measured inside each run, against its own steps:
  the save calls, plus how far the cycles' steps sum above their median (the steps beside the background work and
  the fence wait), less that sum in the runs without checkpoints, over a cycle of typical steps. The machine's drift
  between runs, which moves a run's steps/s by a few percent, cancels in it;
* ``cpu_per_checkpoint_<mode>``: the CPU seconds a checkpoint adds (rank 0's process, against ``none``): on a host
  whose cores training keeps busy, this is what the checkpoints take from training;
* ``background_cpu_per_checkpoint_<mode>``: of those, what ran off the training thread (the kernel's per-thread
  accounting: the process's CPU less the training thread's ``thread_time``, against ``none``): the save's
  background thread and its writer, hashing and fsync pools;
* ``staging``: ours (``async``) against torch's (``torch_stager``), medians of the steady-state saves: training
  blocked (save call + fence wait), the background copy, until durable (from the call's return to the checkpoint
  written and synced: ours also publishes it), the step after a save and the steps while the background works
  (what the background costs training beyond the fence), peak RSS of rank 0 over the ``none`` runs, and the
  ratios torch / ours.

* ``cpu_parts_per_checkpoint_<mode>`` (with ``--profile DIR``: every process of each run sampled by py-spy,
  ``tools/save_parts.py``): each part's CPU seconds per checkpoint and rank, snapshot, serialization, checksums,
  write, fsync, manifest, publish, retention, the rest of the save, and training (py-spy's own sampling adds some
  CPU to the profiled runs: take their throughput from runs without it).

Each step's record also holds ``run_delay``: how long the training thread had waited, runnable, for a core so far
(``/proc/thread-self/schedstat``): what the save's threads and anything else at training's priority took from it.

``--every 1`` checkpoints every step.

``--device cpu`` hides the GPUs (``CUDA_VISIBLE_DEVICES=``); ``--device cuda`` trains on one GPU per process.

``--json OUT`` writes these (and the raw numbers) to OUT. Not a test: the default takes about ten minutes here (each
run about 30 s: ten save cycles, so that one run's noise averages out over them).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_async_torch beside this file

import bench_async_torch  # noqa: E402
import save_parts  # noqa: E402

from automodel_ckpt.recipes.llm_finetune import FinetuneRecipe  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODES = ("none", "sync", "async", "dcp_thread", "dcp_process", "torch_stager")
STAGERS = {"ours": ("none", "sync", "async"), "torch": ("none", "sync", "torch_stager"),
           "both": ("none", "sync", "async", "torch_stager")}
HIDDEN, INTERMEDIATE, VOCAB = 768, 3456, 64
SMALL = {"hidden": 64, "intermediate": 128, "heads": 4, "layers": 2, "steps": 5, "every": 2,
         "modes": ("none", "sync", "async", "dcp_thread", "torch_stager")}

RECIPE = """\
recipe: {recipe}
seed: 42
model:
  _target_: automodel_ckpt.models.build.build_causal_lm
  pretrained_model_name_or_path: null
  dtype: float32
  config:
    model_type: llama
    vocab_size: 64
    hidden_size: {hidden}
    intermediate_size: {intermediate}
    num_hidden_layers: {layers}
    num_attention_heads: {heads}
    num_key_value_heads: {heads}
    max_position_embeddings: 64
    tie_word_embeddings: false
tokenizer:
  pretrained_model_name_or_path: {base}
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
  compile: false
checkpoint:
  checkpoint_dir: {ckpt_dir}
  model_save_format: safetensors
  save_consolidated: false
  is_async: {is_async}
{keep}{logging}"""


def _run_delay() -> float | None:
    """Seconds this thread has waited, runnable, for a core so far (the kernel's schedstat; None where there is none)."""
    try:
        return int(Path("/proc/thread-self/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


class BenchRecipe(FinetuneRecipe):
    """The fine-tuning recipe, timing its steps and checkpoints into ``$BENCH_ASYNC_OUT`` (one JSON per rank).

    ``$BENCH_ASYNC_MODE`` (see ``MODES``) picks how it checkpoints: ``none`` skips saves, ``dcp_*`` and
    ``torch_stager`` save through ``dcp.async_save`` instead of the checkpointer.
    """

    def setup(self) -> None:
        super().setup()
        self._save = self.checkpointer.save  # the checkpointer's step-end call saves through the method below
        self.checkpointer.save = lambda states, info: self.save_checkpoint(info)
        self._mode = os.environ.get("BENCH_ASYNC_MODE", "sync")
        self._timings: dict = {"mode": self._mode, "steps": [], "saves": []}
        self._jobs: list = []  # (save record, async job) to read the fence time from
        self._dcp_future = None
        self._dcp_group = None
        self._torch: bench_async_torch.TorchStagedSaves | None = None
        self._torch_record: dict | None = None  # the torch_stager save whose fence wait is still being counted
        if self._mode in ("dcp_thread", bench_async_torch.MODE):
            import torch.distributed as dist

            self._dcp_group = dist.new_group(backend="gloo")

    def _background_busy(self) -> bool:
        if self._dcp_future is not None:
            return not self._dcp_future.done()
        job = self.checkpointer.stats.background
        return job is not None and any(not f.done() for f in job.writes)

    def train_step(self, micro):
        busy = self._background_busy()
        t0 = time.perf_counter()
        out = super().train_step(micro)
        end = time.perf_counter()
        self._timings["steps"].append({"seconds": end - t0, "end": end, "cpu": time.process_time(),
                                       "thread_cpu": time.thread_time(),  # this (the training) thread's own
                                       "run_delay": _run_delay(),
                                       "background": busy or self._background_busy()})
        return out

    def save_checkpoint(self, info):
        t0 = time.perf_counter()
        path = None
        if self._mode.startswith("dcp_"):
            self._dcp_save(info)
        elif self._mode == bench_async_torch.MODE:
            self._torch_save(info)
        elif self._mode != "none":
            path = self._save(self.checkpointed_state(), info)
        returned = time.perf_counter()
        record = {"step": info.step, "stall": returned - t0, "call": returned - t0, "fence": 0.0,
                  "background": None, "final": info.is_final}
        if self._mode in ("sync", "async"):
            record |= {"phases": dict(self.checkpointer.stats.last_save_seconds),
                       "complete": dict(self.checkpointer.stats.last_complete_seconds)}
        job = self.checkpointer.stats.background
        done = self._dcp_future if self._mode.startswith("dcp_") or self._mode == bench_async_torch.MODE else (
            job.writes[-1] if job is not None and job.writes else None)
        durable = job.completed if job is not None and job.completed is not None else done
        if done is not None:
            done.add_done_callback(lambda _f, r=record: r.__setitem__("background", time.perf_counter() - returned))
        if durable is not None:
            durable.add_done_callback(lambda _f, r=record: r.__setitem__("durable", time.perf_counter() - returned))
        if job is not None:
            self._jobs.append((record, job))
        if self._mode == bench_async_torch.MODE:  # its background copy: until the staged state is complete
            self._torch_record = record
            self._torch.staged.add_done_callback(lambda _f, r=record: r.__setitem__("capture",
                                                                                     time.perf_counter() - returned))
        self._timings["saves"].append(record)
        return path

    def _dcp_save(self, info) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        if self._dcp_future is not None:  # one save in flight, as with the checkpointer
            self._dcp_future.result()
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        kind = AsyncCheckpointerType.PROCESS if self._mode == "dcp_process" else AsyncCheckpointerType.THREAD
        folder = Path(self.checkpoint_config.checkpoint_dir) / f"dcp_step_{info.step}"
        response = dcp.async_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder),
                                  process_group=self._dcp_group, async_checkpointer_type=kind)
        self._dcp_future = getattr(response, "upload_completion", response)

    def _torch_save(self, info) -> None:
        """``torch_stager``: the model and optimizer state through ``async_save`` with a kept ``DefaultStager``."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if self._torch is None:
            self._torch = bench_async_torch.TorchStagedSaves(self.optimizer, self._dcp_group)
        self._torch.wait()  # one save in flight, as with the checkpointer
        self._end_torch_fence()
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        folder = Path(self.checkpoint_config.checkpoint_dir) / f"torch_step_{info.step}"
        self._dcp_future = self._torch.save({"model": model_sd, "optim": optim_sd}, folder)

    def _end_torch_fence(self) -> None:
        """The torch_stager save in flight: its fence wait is final (the next save or the end of the run)."""
        if self._torch is not None and self._torch_record is not None:
            self._torch_record["fence"] = self._torch.fence_seconds
            self._torch_record["stall"] = self._torch_record["call"] + self._torch.fence_seconds
            self._torch_record = None

    def finalize_checkpoints(self):
        t0 = time.perf_counter()
        if self._dcp_future is not None:
            self._dcp_future.result()
            self._dcp_future = None
        if self._torch is not None:
            self._end_torch_fence()
            self._torch.close()
            self._torch = None
        out = super().finalize_checkpoints()
        if self._timings["saves"]:
            self._timings["saves"][-1]["finalize"] = time.perf_counter() - t0
        self._timings["end"] = time.perf_counter()
        self._timings["cpu_end"] = time.process_time()
        self._timings["thread_cpu_end"] = time.thread_time()
        return out

    def run(self) -> None:
        super().run()
        for record, job in self._jobs:  # the next optimizer step waited this long for the background copy
            record["fence"] = job.fence_seconds
            record["capture"] = job.capture_seconds
            record["stall"] = record["call"] + job.fence_seconds
        self._timings["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
        out = os.environ.get("BENCH_ASYNC_OUT")
        if out:
            Path(out, f"rank{self.env.rank}.json").write_text(json.dumps(self._timings, indent=1))


PROFILE_RATE = 100  # py-spy's samples per second with --profile
TRACKING = {"tensorboard": "  tensorboard: {}", "mlflow": "  mlflow: {}", "wandb": "  wandb: {mode: offline}"}


def _logging(tracking: str) -> str:
    """The recipe's `logging:` section for ``--tracking`` (comma-separated backends; empty: none)."""
    names = [t.strip() for t in tracking.split(",") if t.strip()]
    return "logging:\n" + "\n".join(TRACKING[n] for n in names) + "\n" if names else ""


def _state_bytes(hidden: int, intermediate: int, layers: int) -> int:
    params = layers * (4 * hidden * hidden + 3 * hidden * intermediate + 2 * hidden) + 2 * VOCAB * hidden + hidden
    return params * 4 * 3  # fp32 weights + two AdamW moments


def run_mode(work: Path, base: Path, args, mode: str) -> dict:
    recipe_file = work / f"bench_{mode}.yaml"
    ckpt_dir = work / f"ckpt_{mode}"
    recipe_file.write_text(RECIPE.format(
        recipe=f"{Path(__file__).resolve()}:BenchRecipe", base=base, hidden=args.hidden,
        intermediate=args.intermediate, heads=args.heads, layers=args.layers, steps=args.steps, every=args.every,
        gbs=2 * args.nproc, ckpt_dir=ckpt_dir, is_async=str(mode == "async").lower(), logging=_logging(args.tracking),
        keep=f"  max_recent_checkpoints: {args.keep}\n" if args.keep else ""))
    out = work / f"timings_{mode}"
    out.mkdir(exist_ok=True)
    env = dict(os.environ, BENCH_ASYNC_OUT=str(out), BENCH_ASYNC_MODE=mode,
               OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // args.nproc)),
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))))
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, "-m", "automodel_ckpt", "--nproc-per-node", str(args.nproc), str(recipe_file)]
    raw = None
    if args.profile:  # every process of the run sampled (save_parts.py); its CPU counts in this run's figures
        raw = args.profile / f"{mode}_{len(list(args.profile.glob(f'{mode}_*.raw')))}.raw"
        cmd = [args.py_spy, "record", "--subprocesses", "--threads", "--format", "raw", "--rate", str(PROFILE_RATE),
               "-o", str(raw), "--", *cmd]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    shutil.rmtree(ckpt_dir, ignore_errors=True)  # also after a failure: the next repetition must not resume from it
    if proc.returncode != 0:
        return {"mode": mode, "failed": (proc.stdout + proc.stderr)[-2000:]}
    timings = json.loads((out / "rank0.json").read_text())
    timings["wall"], timings["nproc"] = wall, args.nproc
    steps = timings["steps"]
    timings["run_seconds"] = timings["end"] - steps[0]["end"]  # from the end of the first (warm-up) step
    timings["steps_per_second"] = (len(steps) - 1) / timings["run_seconds"]
    first, last = args.every, (len(steps) - 1) // args.every * args.every  # whole save cycles, not the final save
    if last > first:  # from the end of step `every` (its save next) to the end of the last such step before the end
        timings["steady_steps_per_second"] = (last - first) / (steps[last - 1]["end"] - steps[first - 1]["end"])
        # within the run: the window's steps above their own median, and the save calls in it, per cycle
        window, calls = steps[first:last], [x["call"] for x in timings["saves"] if first <= x["step"] < last]
        typical = statistics.median(x["seconds"] for x in window)
        timings["typical_step_seconds"], timings["cycle_steps"] = typical, args.every
        timings["excess_seconds_per_cycle"] = (sum(x["seconds"] - typical for x in window) + sum(calls)) / (
            (last - first) // args.every)
    timings["cpu_seconds"] = timings["cpu_end"] - steps[0]["cpu"]  # rank 0's process, same span
    # the kernel's per-thread accounting: the training thread's CPU, and the rest of the process's (the save's
    # background thread and its writer, hashing and fsync pools, the data loader, torch's own threads)
    timings["training_thread_cpu_seconds"] = timings["thread_cpu_end"] - steps[0]["thread_cpu"]
    timings["other_threads_cpu_seconds"] = timings["cpu_seconds"] - timings["training_thread_cpu_seconds"]
    if raw is not None and raw.exists():
        timings["cpu_parts"] = save_parts.parts(raw, PROFILE_RATE)  # every rank, the whole run
    return timings


def steady(saves: list[dict]) -> list[dict]:
    """The checkpoints that are neither the first (allocates host buffers) nor the final one (completed at once)."""
    body = [s for s in saves if not s["final"]]
    return body[1:] or body


#: the async save call's phases (``Checkpointer.stats.last_save_seconds``) as the stall's parts
STALL_PARTS = {"complete_previous": "complete_previous", "reserve": "reserve", "snapshot": "copy_small",
               "small_files": "write_local", "hand_off": "start_background"}


def stall_parts(saves: list[dict]) -> dict:
    """What an async save's stall is made of, medians over ``saves`` (seconds): the previous save completed, the
    staging folder reserved, the ``snapshot`` (state dicts collected, small tensors and buffers copied), the
    ``small_files`` (per-rank and global states serialized, metadata built), the ``hand_off`` to the background
    thread, ``other`` (the rest of the call: the recipe's state discovered, the save named and announced) and the
    ``fence`` wait of the next optimizer step."""
    if not saves:
        return {}
    parts = {part: statistics.median(s.get("phases", {}).get(phase, 0.0) for s in saves)
             for part, phase in STALL_PARTS.items()}
    parts["other"] = statistics.median(max(0.0, s["call"] - sum(s.get("phases", {}).values())) for s in saves)
    parts["fence"] = statistics.median(s["fence"] for s in saves)
    return parts


def _lost(rates: list[float], without: list[float]) -> tuple[float, list[float]]:
    """The fraction of steps/s lost, median of ``rates`` against the median of ``without`` (the runs without
    checkpoints), and each repetition's smallest and largest loss against that median."""
    reference = statistics.median(without)
    each = sorted(1 - r / reference for r in rates)
    return 1 - statistics.median(rates) / reference, [each[0], each[-1]]


def _within(runs: list[dict], without: list[dict]) -> tuple[float, list[float]]:
    """What a save costs the steps within each run (the save call, and the steps of the save cycles above their
    median, less the same excess of the runs without checkpoints), as a share of a cycle of typical steps of the
    runs without: the median over the repetitions, and the smallest and largest. A machine's drift from one run
    to the next, which moves the runs' steps/s by a few percent, cancels in it."""
    base = statistics.median(r["excess_seconds_per_cycle"] for r in without)
    cycle = statistics.median(r["typical_step_seconds"] * r["cycle_steps"] for r in without)
    each = sorted((r["excess_seconds_per_cycle"] - base) / cycle for r in runs)
    return statistics.median(each), [each[0], each[-1]]


def summary(results: dict[str, list[dict]]) -> dict:
    """The ratios (see the module docstring) over every repetition; a mode that failed or did not run has None."""
    ok = {m: [r for r in runs if "failed" not in r] for m, runs in results.items()}
    ok = {m: runs for m, runs in ok.items() if runs}
    out: dict = {"stall_over_sync": None}
    if "sync" in ok and "async" in ok:
        sync = statistics.median(s["stall"] for r in ok["sync"] for s in steady(r["saves"]))
        asyn = statistics.median(s["stall"] for r in ok["async"] for s in steady(r["saves"]))
        out |= {"stall_over_sync": asyn / sync, "sync_save_seconds": sync, "async_stall_seconds": asyn,
                "stall_parts": stall_parts([s for r in ok["async"] for s in steady(r["saves"])])}
    rate = {m: statistics.median(r["steps_per_second"] for r in runs) for m, runs in ok.items()}
    cycles = {m: [r["steady_steps_per_second"] for r in runs if "steady_steps_per_second" in r]
              for m, runs in ok.items()}  # whole save cycles only: no final save, no wait for it
    for mode in MODES[1:]:
        if mode in results:
            lost = cpu = None
            if mode in ok and "none" in ok:
                lost, out[f"run_overhead_spread_{mode}"] = _lost([r["steps_per_second"] for r in ok[mode]],
                                                                 [r["steps_per_second"] for r in ok["none"]])
                saves = statistics.median(len(r["saves"]) for r in ok[mode]) or 1
                per_step = statistics.median(r["cpu_seconds"] / (len(r["steps"]) - 1) for r in ok["none"])
                cpu = statistics.median(r["cpu_seconds"] - per_step * (len(r["steps"]) - 1) for r in ok[mode]) / saves
                idle = statistics.median(r["other_threads_cpu_seconds"] for r in ok["none"])
                out[f"background_cpu_per_checkpoint_{mode}"] = statistics.median(
                    r["other_threads_cpu_seconds"] - idle for r in ok[mode]) / saves
            out[f"run_overhead_{mode}"] = lost
            out[f"cpu_per_checkpoint_{mode}"] = cpu
            if cycles.get(mode) and cycles.get("none"):
                out[f"steady_overhead_{mode}"], out[f"steady_overhead_spread_{mode}"] = _lost(cycles[mode],
                                                                                            cycles["none"])
                out[f"within_run_cost_{mode}"], out[f"within_run_cost_spread_{mode}"] = _within(ok[mode], ok["none"])
    out["steps_per_second"] = rate
    for mode, runs in ok.items():  # --profile: each part's CPU seconds per checkpoint and rank (medians)
        profiled = [r for r in runs if r.get("cpu_parts") and r["saves"]]
        if profiled:
            out[f"cpu_parts_per_checkpoint_{mode}"] = {part: statistics.median(
                r["cpu_parts"][part] / len(r["saves"]) / r["nproc"] for r in profiled) for part in save_parts.PARTS}
    return out


def table(results: dict[str, list[dict]], ratios: dict) -> str:
    rows = ["| checkpoint | sync save (s) | async stall (s) | of which: fence wait (s) | async stall / sync save "
            "| background copy (s) | background write (s) |", "|---|---|---|---|---|---|---|"]
    for rep, (sync, asyn) in enumerate(zip(results.get("sync", []), results.get("async", []))):
        for s, a in zip(sync.get("saves", []), asyn.get("saves", [])):
            if s["final"]:
                continue
            bg = f"{a['background']:.2f}" if a.get("background") is not None else "-"
            cap = f"{a['capture']:.2f}" if a.get("capture") is not None else "-"
            where = f"step {s['step']}" + (f" (run {rep + 1})" if len(results["sync"]) > 1 else "")
            rows.append(f"| {where} | {s['stall']:.3f} | {a['stall']:.3f} | {a['fence']:.3f} | "
                        f"{100 * a['stall'] / s['stall']:.1f}% | {cap} | {bg} |")
    lines = ["\n".join(rows), ""] if len(rows) > 2 else []  # per checkpoint: only with both sync and async
    if ratios.get("stall_over_sync") is not None:
        lines.append(f"stall_over_sync (median, steady state): {100 * ratios['stall_over_sync']:.1f}%")
        parts = ratios.get("stall_parts") or {}
        if parts:
            lines.append("stall parts (median ms): " + ", ".join(f"{k} {1000 * v:.2f}" for k, v in parts.items()))
    lines += ["", "| run | steps/s (median) | tokens/s lost vs no checkpoints (min to max) | steady state: lost (min "
              "to max) | within the runs: lost (min to max) | CPU s per checkpoint | of which off the training thread | step "
              "time median (s) |", "|---|---|---|---|---|---|---|---|"]
    for mode, runs in results.items():
        good = [r for r in runs if "failed" not in r]
        if not good:
            lines.append(f"| {mode} | failed: {runs[0]['failed'].strip().splitlines()[-1][:120]} | - | - | - | - | - "
                         "| - |")
            continue
        lost, cpu = ratios.get(f"run_overhead_{mode}"), ratios.get(f"cpu_per_checkpoint_{mode}")
        spread, off = ratios.get(f"run_overhead_spread_{mode}"), ratios.get(f"background_cpu_per_checkpoint_{mode}")
        med = statistics.median(x["seconds"] for r in good for x in r["steps"][1:] or r["steps"])
        lost_text = "-" if lost is None else f"{100 * lost:+.1f}%" + (
            f" ({100 * spread[0]:+.1f}% to {100 * spread[1]:+.1f}%)" if spread else "")
        steady, steady_spread = ratios.get(f"steady_overhead_{mode}"), ratios.get(f"steady_overhead_spread_{mode}")
        steady_text = "-" if steady is None else f"{100 * steady:+.1f}% ({100 * steady_spread[0]:+.1f}% to " \
                                                  f"{100 * steady_spread[1]:+.1f}%)"
        within, within_spread = ratios.get(f"within_run_cost_{mode}"), ratios.get(f"within_run_cost_spread_{mode}")
        within_text = "-" if within is None else f"{100 * within:+.1f}% ({100 * within_spread[0]:+.1f}% to " \
                                                  f"{100 * within_spread[1]:+.1f}%)"
        lines.append(f"| {mode} | {ratios['steps_per_second'][mode]:.3f} | {lost_text} | {steady_text} | {within_text} | "
                     f"{'-' if cpu is None else f'{cpu:.2f}'} | {'-' if off is None else f'{off:.2f}'} | {med:.3f} |")
    for mode in results:
        found = ratios.get(f"cpu_parts_per_checkpoint_{mode}")
        if found:
            lines.append(f"{mode}: CPU s per checkpoint and rank, by part: " +
                         ", ".join(f"{part} {value:.4f}" for part, value in found.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=201)  # ten save cycles a run: a run's own noise averages out
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--reps", type=int, default=2, help="runs per mode, interleaved")
    parser.add_argument("--keep", type=int, default=None,
                        help="checkpoint.max_recent_checkpoints: retention deletes the older ones (default: all kept)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {', '.join(MODES)}")
    parser.add_argument("--stager", choices=sorted(STAGERS), default=None,
                        help="instead of --modes: ours (async), torch (torch_stager) or both, with none and sync")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="cpu hides the GPUs; cuda trains on one per process (default: a GPU if there is one)")
    parser.add_argument("--tracking", default="", help=f"experiment trackers to log to, comma-separated, from "
                                                       f"{', '.join(TRACKING)} (default: none)")
    parser.add_argument("--small", action="store_true", help="a tiny model and few steps (checks the tool)")
    parser.add_argument("--json", type=Path, default=None, help="write the ratios and raw numbers here")
    parser.add_argument("--out", type=Path, default=None, help="folder for the runs (default: a temporary one)")
    parser.add_argument("--profile", type=Path, default=None,
                        help="sample every run with py-spy into this folder: the save's CPU by part (save_parts.py)")
    parser.add_argument("--py-spy", default="py-spy", help="the py-spy program (pip install py-spy)")
    args = parser.parse_args(argv)
    if args.profile:
        if shutil.which(args.py_spy) is None:
            parser.error(f"--profile: {args.py_spy} not found (pip install py-spy, or --py-spy PATH)")
        args.profile.mkdir(parents=True, exist_ok=True)
    args.hidden, args.intermediate, args.heads = HIDDEN, INTERMEDIATE, 12
    modes = list(STAGERS[args.stager]) if args.stager else [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.small:
        args.hidden, args.intermediate, args.heads = SMALL["hidden"], SMALL["intermediate"], SMALL["heads"]
        args.layers, args.steps, args.every, args.reps = SMALL["layers"], SMALL["steps"], SMALL["every"], 1
        modes = [m for m in modes if m in SMALL["modes"]]
    bad = sorted({t.strip() for t in args.tracking.split(",") if t.strip()} - set(TRACKING))
    if bad:
        parser.error(f"--tracking: unknown {', '.join(bad)} (choose from {', '.join(TRACKING)})")
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"--modes: unknown {', '.join(unknown)} (choose from {', '.join(MODES)})")
    work = args.out or Path(tempfile.mkdtemp(prefix="bench_async_"))
    work.mkdir(parents=True, exist_ok=True)
    from automodel_ckpt.models.tiny import ensure_tiny_base

    base = ensure_tiny_base(work / "tiny_llama_base")  # its tokenizer; the model is built from the config above
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no GPU visible")
    state = _state_bytes(args.hidden, args.intermediate, args.layers)
    print(f"state: {state / 1e9:.3f} GB (weights + AdamW), {args.nproc} process(es), {args.steps} steps, a "
          f"checkpoint every {args.every}; torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, device {args.device or ('cuda' if torch.cuda.is_available() else 'cpu')}; "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    results: dict[str, list[dict]] = {mode: [] for mode in modes}
    load_start = os.getloadavg()
    for rep in range(args.reps):
        for mode in modes:
            run = run_mode(work, base, args, mode)
            results[mode].append(run)
            print(f"{mode} run {rep + 1} {'failed' if 'failed' in run else 'done'} ({run.get('wall', 0):.0f} s)",
                  flush=True)
    ratios = summary(results)
    staging = bench_async_torch.compare(results)
    print(table(results, ratios))
    if staging:
        print("\n" + bench_async_torch.compare_table(staging, ratios))
    report = ratios | {"staging": staging, "device": args.device, "state_bytes": state, "nproc": args.nproc,
                       "steps": args.steps, "every": args.every, "reps": args.reps, "keep": args.keep,
                       "tracking": args.tracking, "cpu_count": os.cpu_count(), "torch": torch.__version__,
                       "load_average_start": load_start, "load_average": os.getloadavg(), "runs": results}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
        print(f"json: {args.json}")
    if not args.out:
        shutil.rmtree(work, ignore_errors=True)
    failed = [(mode, run["failed"]) for mode, runs in results.items() for run in runs if "failed" in run]
    for mode, tail in failed:
        print(f"{mode} run failed:\n{tail}", file=sys.stderr)
    if failed:
        raise SystemExit(1)
    return report


if __name__ == "__main__":
    main()
