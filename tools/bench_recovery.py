"""The node-local tier on two nodes: save stall, whole-run overhead, recovery after a killed worker, memory used.

    python tools/bench_recovery.py [--size-gb 1] [--kill-after 17] [--durable-every 10] [--reps 1]
        [--local-root /dev/shm] [--no-drop-cache] [--durable-store disk|s3 [--endpoint URL]] [--json OUT] [--out DIR]
    python tools/bench_recovery.py --small --json OUT     # a tiny model, few steps, page cache kept: checks the tool
    python tools/bench_recovery.py --from-json OUT        # the report of an earlier run again

Trains a Llama-style model (hidden 768, fp32 weights + AdamW moments: ``--size-gb`` of training state sets the
number of layers) on the embedded tiny task with ``ckpt-train`` launched once per node, ``--nnodes 2
--nproc-per-node 1``: two nodes on this machine, each with its own node-local folder (``--local-root``, default
``/dev/shm``). Every run takes a durable checkpoint (``checkpoint.is_async: true``) every ``--durable-every``
steps, into a folder (``--durable-store disk``, the default) or an object store (``s3``: a SeaweedFS server this
tool starts on loopback, or ``--endpoint`` with the AWS variables; one staging folder both nodes share, as the
object store asks of several nodes); the runs:

* ``none``: no node-local steps (the throughput reference);
* ``durable``: a durable async checkpoint every 2 steps instead (the stall of an async durable save);
* ``local``: a node-local step every 2 steps (``checkpoint.local.every_steps: 2``, ``replicas: 1``, ``keep: 1``);
  when step ``--kill-after`` is done (the local step before it committed on both nodes: the time that took is
  reported), the node-1 worker SIGKILLs itself, and node 0's worker fails at its next collective;
* ``rerun_local``: the same two launches on the state the kill left, page cache dropped: they resume from the
  newest local step;
* ``rerun_durable``: the same killed state with both node-local folders (and the object store's staging folder)
  removed, page cache dropped: they resume from the durable tier.

Rank 0 records every step's end and every save's ``stall`` (the wall time the training thread lost to it: the save
call, plus the time the next ``optimizer.step()`` waited at the fence for the snapshot), as ``bench_async`` does.
Reported, with the goals of docs/fast-recovery.md:

* ``stall_local_over_durable``: median local-step stall over median async durable stall (steady state: not the
  first save of each kind, which allocates host buffers); goal <= 1;
* ``run_overhead_local``: tokens/s lost by ``local`` against ``none`` from the end of step 1 to the end of step
  ``--kill-after`` (same tokens per step); goal <= 3%. ``run_overhead_durable`` the same for ``durable``;
* per rerun: ``tier``, the step resumed from, ``load_seconds`` (the start event's, ``events.jsonl``), the time from
  the kill to the next completed step (``detect_seconds``: the kill until both launchers exited, plus
  ``restart_seconds``: the relaunch until the first step is done), the time until the step done last before the
  kill is done again (``kill_to_caught_up_seconds``), ``steps_lost`` (steps done before the kill and done again;
  goal <= every_steps) and whether its losses equal the uninterrupted ``none`` run's;
  ``load_durable_over_local`` (goal >= 3); and where the restore spent its time on rank 0 (``restore_phases``:
  finding and checking the step, gathering its parts on every node, loading; for the durable tier, finding and
  probing the checkpoint, loading);
* ``local_bytes_at_kill`` and ``local_bytes_peak`` (sampled during the run): the memory both node-local folders
  use, over ``state_bytes`` (the training state: fp32 weights and two AdamW moments).

``--json OUT`` writes these and the raw numbers (``--from-json`` reports them again). Not a test: the default
took 16 minutes on a 2-core machine that other jobs were keeping busy.

Times internals: imports ``checkpoint.restore`` and ``checkpoint.storage`` (it wraps their functions) directly.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from automodel_ckpt.ondisk import RunFolder
from automodel_ckpt.recipes.llm_finetune import FinetuneRecipe

REPO = Path(__file__).resolve().parents[1]
HIDDEN, INTERMEDIATE, HEADS, VOCAB = 768, 3456, 12, 64
LOCAL_EVERY = 2
SMALL = {"hidden": 64, "intermediate": 128, "heads": 4, "layers": 2, "kill_after": 7, "durable_every": 4}

RECIPE = """\
recipe: {recipe}
seed: 42
model:
  _target_: automodel_ckpt.models.build.build_causal_lm
  pretrained_model_name_or_path: null
  dtype: float32
  config:
    model_type: llama
    vocab_size: {vocab}
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
  global_batch_size: 4
  local_batch_size: 2
  max_steps: {steps}
  ckpt_every_steps: {every}
  val_every_steps: null
optimizer:
  _target_: torch.optim.AdamW
  lr: 1.0e-4
training:
  progress_bar: false
checkpoint:
  checkpoint_dir: {ckpt_dir}
  model_save_format: safetensors
  save_consolidated: false
  is_async: true
  local:
    every_steps: {local_every}
    replicas: 1
    keep: 1
"""


class BenchRecoveryRecipe(FinetuneRecipe):
    """The fine-tuning recipe, timing its steps, durable saves and node-local steps into
    ``$BENCH_RECOVERY_OUT/rank<R>.json`` (rewritten after every step, so a killed run leaves them too).

    With ``$BENCH_RECOVERY_KILL_AFTER`` = N, every rank waits for the node-local step in flight to be committed
    once step N is done, then rank 1 writes ``kill.json`` (when, which step) and SIGKILLs itself.
    """

    def setup(self) -> None:
        super().setup()
        # the checkpointer's step-end call saves through the two methods below
        self._saves = self.checkpointer.save, self.checkpointer._save_local
        self.checkpointer.save = lambda states, info: self.save_checkpoint(info)
        self.checkpointer._save_local = lambda states, info: self.save_local_checkpoint(info)
        self._out = Path(os.environ["BENCH_RECOVERY_OUT"])
        self._kill_after = int(os.environ.get("BENCH_RECOVERY_KILL_AFTER", "-1"))
        self._timings: dict = {"steps": [], "saves": [], "local": []}
        self._unfenced: list[tuple[dict, object]] = []  # saves whose fence wait the next step settles
        self._clock_restore()

    def _clock_restore(self) -> None:
        """Time the phases of a restore (each tier's: find and check, gather, load) into ``restore_phases``."""
        from automodel_ckpt.checkpoint.restore import resume
        from automodel_ckpt.checkpoint.storage.nodelocal import recover

        phases = self._timings["restore_phases"] = {}

        def clocked(fn, name):
            def run(*args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0
            return run

        ckpt = self.checkpointer
        recover.newest_step = clocked(recover.newest_step, "local_find_and_verify")
        recover.make_whole = clocked(recover.make_whole, "local_make_whole")
        if ckpt._local.active:
            ckpt._local.loader.load = clocked(ckpt._local.loader.load, "local_load")
        resume.decide = clocked(resume.decide, "durable_find_and_probe")
        ckpt._loader.load = clocked(ckpt._loader.load, "durable_load")

    def train_step(self, micro):
        if self.step_scheduler.step == self._kill_after:
            self._kill()
        t0 = time.perf_counter()
        out = super().train_step(micro)
        end = time.perf_counter()
        for record, job in self._unfenced:  # this step's optimizer.step() waited at the fence, if at all
            record["fence"] = job.fence_seconds
            record["stall"] = record["call"] + job.fence_seconds
        self._unfenced.clear()
        self._timings["steps"].append({"step": self.step_scheduler.step + 1, "seconds": end - t0, "end": end,
                                       "wall": time.time(), "cpu": time.process_time()})
        self._dump()
        return out

    def save_checkpoint(self, info):
        return self._timed(lambda: self._saves[0](self.checkpointed_state(), info), info,
                           lambda: self.checkpointer.stats.background, self._timings["saves"])

    def save_local_checkpoint(self, info):
        return self._timed(lambda: self._saves[1](self.checkpointed_state(), info), info,
                           lambda: self.checkpointer._local.writer.background, self._timings["local"])

    def _timed(self, save, info, background, records: list):
        t0 = time.perf_counter()
        path = save()
        returned = time.perf_counter()
        record = {"step": info.step, "call": returned - t0, "fence": 0.0, "stall": returned - t0,
                  "background": None, "final": info.is_final}
        job = background()
        if job is not None:
            done = job.completed if job.completed is not None else (job.writes[-1] if job.writes else None)
            if done is not None:
                done.add_done_callback(lambda _f, r=record: r.__setitem__("background", time.perf_counter() - returned))
            self._unfenced.append((record, job))
        records.append(record)
        return path

    def _kill(self) -> None:
        t0 = time.perf_counter()
        self.checkpointer._local.writer.wait()  # collective: the local step before the kill, committed everywhere
        waited = time.perf_counter() - t0
        self._timings["commit_wait"] = waited
        self._dump()
        if self.env.rank == 1:
            kill = {"wall": time.time(), "step": self.step_scheduler.step, "commit_wait": waited}
            (self._out / "kill.json").write_text(json.dumps(kill))
            os.kill(os.getpid(), signal.SIGKILL)

    def finalize_checkpoints(self):
        out = super().finalize_checkpoints()
        self._dump()  # the final save's record
        return out

    def _dump(self) -> None:
        path = self._out / f"rank{self.env.rank}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self._timings))
        tmp.replace(path)


def layers_for(size_gb: float, hidden: int, intermediate: int) -> int:
    """Layers that make about ``size_gb`` of training state (at least 1)."""
    per_layer = _state_bytes(hidden, intermediate, 1) - _state_bytes(hidden, intermediate, 0)
    return max(1, round((size_gb * 1e9 - _state_bytes(hidden, intermediate, 0)) / per_layer))


def _state_bytes(hidden: int, intermediate: int, layers: int) -> int:
    params = layers * (4 * hidden * hidden + 3 * hidden * intermediate + 2 * hidden) + 2 * VOCAB * hidden + hidden
    return params * 4 * 3  # fp32 weights + two AdamW moments


def tree_bytes(*folders: Path) -> int:
    """The memory the files under ``folders`` take (allocated blocks; a tmpfs holds them in RAM)."""
    total = 0
    for folder in folders:
        for root, _dirs, files in os.walk(folder):
            for name in files:
                try:
                    total += os.lstat(os.path.join(root, name)).st_blocks * 512
                except FileNotFoundError:  # renamed or pruned meanwhile
                    pass
    return total


def drop_page_cache() -> bool:
    """Write dirty pages back and drop the page cache; False where this process may not (not root)."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ObjectStore:
    """The durable tier on an object store (``--durable-store s3``): its bucket, credentials and filesystem."""

    def __init__(self, work: Path, endpoint: str | None, bucket: str | None) -> None:
        sys.path.insert(0, str(REPO))
        from tests.integration.seaweed import for_benchmark

        # a SeaweedFS server on loopback, as the tests start it, or the endpoint; the launches inherit the variables
        self.server, bucket = for_benchmark(work / "seaweed", endpoint, bucket)
        from automodel_ckpt.checkpoint import open_filesystem

        self.prefix, self.url = f"{bucket}/run", f"s3://{bucket}/run"
        self.fs = open_filesystem(self.url)

    def files(self) -> list[str]:
        """Every object of the run folder, relative to it."""
        self.fs.invalidate_cache()
        found = self.fs.find(self.prefix) if self.fs.exists(self.prefix) else []
        return [path[len(self.prefix) + 1:] for path in found]

    def clear(self) -> None:
        objects = [f"{self.prefix}/{rel}" for rel in self.files()]
        if objects:
            self.fs.rm(objects)

    def download(self, to: Path) -> None:
        for rel in self.files():
            (to / rel).parent.mkdir(parents=True, exist_ok=True)
            self.fs.get_file(f"{self.prefix}/{rel}", str(to / rel))

    def upload(self, source: Path) -> None:
        for path in sorted(p for p in source.rglob("*") if p.is_file()):
            self.fs.put_file(str(path), f"{self.prefix}/{path.relative_to(source).as_posix()}")

    def newest_checkpoint_bytes(self) -> int | None:
        """The size of the checkpoint the store's ``LATEST`` names."""
        latest = f"{self.prefix}/{RunFolder.latest}"
        if not self.fs.exists(latest):
            return None
        return self.fs.du(f"{self.prefix}/{self.fs.cat_file(latest).decode().strip()}")

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


class Runs:
    """Where the runs of one repetition live: the recipe, the run folder, the two node-local folders, timings.

    With ``store`` the durable tier is its run folder, worked through one staging folder both nodes share
    (``stage``: the object store's multi-node requirement, docs/object-storage.md), where rank 0's logs are read."""

    def __init__(self, work: Path, local_root: Path, base: Path, args, store: ObjectStore | None = None) -> None:
        self.work, self.args, self.store = work, args, store
        self.nodes = [local_root / f"node{r}" for r in (0, 1)]
        self.ckpt_dir = work / "run"
        self.stage = work / "stage" if store else None
        self.logs = self.stage or self.ckpt_dir
        self.folders = [self.ckpt_dir, *self.nodes, *([self.stage] if store else [])]  # what a run leaves on disk
        self.recipe = {every: work / f"bench_local{every}.yaml" for every in (0, LOCAL_EVERY)}
        for every, path in self.recipe.items():
            path.write_text(RECIPE.format(
                recipe=f"{Path(__file__).resolve()}:BenchRecoveryRecipe", base=base, vocab=VOCAB, hidden=args.hidden,
                intermediate=args.intermediate, heads=args.heads, layers=args.layers, steps=args.kill_after + 1,
                every=args.durable_every, ckpt_dir=store.url if store else self.ckpt_dir, local_every=every))

    def launch(self, tag: str, *, local: bool, durable_every: int | None = None, kill: bool = False) -> dict:
        """Both nodes of one run; returns when both launchers have exited, with their exit times and codes."""
        out = self.work / f"timings_{tag}"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        env = dict(os.environ, BENCH_RECOVERY_OUT=str(out), OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // 2)),
                   HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO))
        if kill:
            env["BENCH_RECOVERY_KILL_AFTER"] = str(self.args.kill_after)
        port = str(_free_port())
        extra = ["--step_scheduler.ckpt_every_steps", str(durable_every)] if durable_every else []
        recipe = self.recipe[LOCAL_EVERY if local else 0]
        procs, exits = [], [None, None]
        started = time.time()
        for r in (0, 1):
            cmd = [sys.executable, "-m", "automodel_ckpt", "--nnodes", "2", "--node-rank", str(r),
                   "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", port,
                   str(recipe), *extra, *(["--checkpoint.local.dir", str(self.nodes[r])] if local else []),
                   *(["--checkpoint.staging_dir", str(self.stage)] if self.store else [])]
            log = (self.work / f"{tag}_node{r}.log").open("w")
            procs.append((subprocess.Popen(cmd, cwd=self.work, env=env, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True), log))

        def wait(r: int) -> None:
            try:
                procs[r][0].wait(timeout=self.args.timeout)
            except subprocess.TimeoutExpired:  # a launch that hangs fails the run; the report says where
                os.killpg(procs[r][0].pid, signal.SIGKILL)  # the launcher and its worker
                procs[r][0].wait()
            exits[r] = time.time()

        waiters = [threading.Thread(target=wait, args=(r,)) for r in (0, 1)]
        for t in waiters:
            t.start()
        peak = 0
        while any(t.is_alive() for t in waiters):  # the node-local folders' largest size, sampled
            peak = max(peak, tree_bytes(*self.nodes))
            for t in waiters:
                t.join(timeout=0.2)
        peak = max(peak, tree_bytes(*self.nodes))
        for _, log in procs:
            log.close()
        codes = [p.returncode for p, _ in procs]
        run = {"tag": tag, "launched": started, "exited": exits, "returncodes": codes, "local_bytes_peak": peak,
               "wall": max(exits) - started}
        rank0 = out / "rank0.json"
        run |= json.loads(rank0.read_text()) if rank0.is_file() else {}
        if (out / "kill.json").is_file():
            run["kill"] = json.loads((out / "kill.json").read_text())
        if (codes != [0, 0]) != kill or (kill and "kill" not in run):
            run["failed"] = "\n".join(self.tail(tag, r) for r in (0, 1))
        return run

    def tail(self, tag: str, rank: int) -> str:
        text = (self.work / f"{tag}_node{rank}.log").read_text(errors="replace")
        return f"--- {tag}, node {rank}:\n{text[-2000:]}"

    def records(self) -> dict[int, dict]:
        lines = RunFolder(self.logs).training_log.read_text().splitlines()
        return {r["step"]: r for r in map(json.loads, lines)}

    def last_start(self) -> dict:
        lines = RunFolder(self.logs).events_log.read_text().splitlines()
        return [e for e in map(json.loads, lines) if e["event"] == "start"][-1]

    def clear(self) -> None:
        for folder in self.folders:
            shutil.rmtree(folder, ignore_errors=True)
        if self.store:
            self.store.clear()

    def durable_checkpoint_bytes(self) -> int | None:
        """The size of the durable checkpoint ``LATEST`` names."""
        if self.store:
            return self.store.newest_checkpoint_bytes()
        latest = RunFolder(self.ckpt_dir).latest
        return tree_bytes(latest.resolve()) if latest.exists() else None

    def keep(self, kept: Path) -> None:
        """Copy what the killed run left (run folder, node-local and staging folders) to ``kept``."""
        for folder in self.folders:
            if folder.exists():
                shutil.copytree(folder, kept / folder.name, symlinks=True)
        if self.store:
            self.store.download(kept / "store")

    def restore(self, kept: Path, tier: str) -> None:
        """Put back what the killed run left; for the durable tier's rerun, only the durable run folder (the nodes
        are new machines: no node-local folder, no staging folder)."""
        self.clear()
        for folder in self.folders:
            if (kept / folder.name).exists() and (tier == "local" or folder == self.ckpt_dir):
                shutil.copytree(kept / folder.name, folder, symlinks=True)
        if self.store:
            self.store.upload(kept / "store")


def span_rate(run: dict, last: int) -> float | None:
    """Steps per second from the end of step 1 to the end of step ``last``."""
    ends = {s["step"]: s["end"] for s in run.get("steps", [])}
    return (last - 1) / (ends[last] - ends[1]) if 1 in ends and last in ends else None


def span_cpu(run: dict, last: int) -> float | None:
    """The CPU seconds of rank 0's process (training and background threads) over the same span."""
    cpu = {s["step"]: s["cpu"] for s in run.get("steps", [])}
    return cpu[last] - cpu[1] if 1 in cpu and last in cpu else None


def saves_in_span(run: dict, last: int) -> int:
    """The saves of both tiers taken between the end of step 1 and the end of step ``last``."""
    return sum(1 for s in run.get("saves", []) + run.get("local", []) if s["step"] < last)


def steady(saves: list[dict]) -> list[dict]:
    """Saves that are neither the first of their kind (allocates host buffers) nor the final one."""
    body = [s for s in saves if not s["final"]]
    return body[1:] or body


def one_repetition(runs: Runs, args) -> dict:
    """The five runs (see the module docstring) and what they measure."""
    rep: dict = {}
    runs.clear()
    rep["none"] = runs.launch("none", local=False)
    reference = runs.records() if "failed" not in rep["none"] else {}
    runs.clear()
    rep["durable"] = runs.launch("durable", local=False, durable_every=LOCAL_EVERY)
    runs.clear()
    rep["local"] = runs.launch("local", local=True, kill=True)
    if "failed" in rep["local"]:
        return rep
    rep["local_bytes_at_kill"] = tree_bytes(*runs.nodes)
    rep["durable_checkpoint_bytes"] = runs.durable_checkpoint_bytes()
    kept = runs.work / "killed"
    runs.keep(kept)
    for tier in ("local", "durable"):
        runs.restore(kept, tier)
        dropped = drop_page_cache() if args.drop_cache else False
        run = runs.launch(f"rerun_{tier}", local=True)
        run["page_cache_dropped"] = dropped
        rep[f"rerun_{tier}"] = run
        if "failed" not in run:
            run |= recovery(runs, run, reference)
    shutil.rmtree(kept, ignore_errors=True)
    runs.clear()
    return rep


def recovery(runs: Runs, rerun: dict, reference: dict) -> dict:
    """What a rerun of the killed state shows: which tier and step it resumed from, its load phase, and whether
    its losses are those of the uninterrupted run."""
    start, got = runs.last_start(), runs.records()
    differ = [s for s, r in reference.items() if got.get(s, {}).get("loss") != r["loss"]]
    return {
        "tier": start.get("tier"), "resumed_step": start["step"], "resumed_from": start.get("resumed_from"),
        "load_seconds": start.get("load_seconds"), "restore_phases": rerun.get("restore_phases", {}),
        "losses_match": bool(reference) and not differ, "steps_not_matching": differ,
    }


def timeline(killed: dict, rerun: dict) -> dict:
    """The rerun's times from the kill: until both launchers exited, until its first step, until the step the
    killed run had done last is done again; and the steps done again."""
    kill = killed["kill"]
    detect = max(killed["exited"]) - kill["wall"]
    first = rerun["steps"][0]["wall"] - rerun["launched"]
    back = next((s["wall"] - rerun["launched"] for s in rerun["steps"] if s["step"] == kill["step"]), None)
    return {"detect_seconds": detect, "restart_seconds": first, "kill_to_step_seconds": detect + first,
            "kill_to_caught_up_seconds": None if back is None else detect + back,
            "steps_lost": kill["step"] - rerun["resumed_step"]}


def summary(reps: list[dict], args) -> dict:
    """The ratios of the module docstring, medians over the repetitions (None where a run failed)."""
    def ok(kind: str) -> list[dict]:
        return [r[kind] for r in reps if kind in r and "failed" not in r[kind]]

    def median(values: list) -> float | None:
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    out: dict = {}
    local = median([s["stall"] for r in ok("local") for s in steady(r["local"])])
    durable = median([s["stall"] for r in ok("durable") for s in steady(r["saves"])])
    out |= {"local_stall_seconds": local, "durable_stall_seconds": durable,
            "stall_local_over_durable": local / durable if local is not None and durable else None}
    rate = {kind: median([span_rate(r, args.kill_after) for r in ok(kind)]) for kind in ("none", "durable", "local")}
    out["steps_per_second"] = rate
    last = args.kill_after
    none_cpu = median([span_cpu(r, last) for r in ok("none")])
    none_saves = median([saves_in_span(r, last) for r in ok("none")])
    for kind in ("local", "durable"):
        out[f"run_overhead_{kind}"] = 1 - rate[kind] / rate["none"] if rate[kind] and rate["none"] else None
        added = [(span_cpu(r, last) - none_cpu) / (saves_in_span(r, last) - none_saves) for r in ok(kind)
                 if none_cpu is not None and span_cpu(r, last) is not None and saves_in_span(r, last) > none_saves]
        out[f"cpu_per_save_{kind}"] = median(added)  # rank 0's CPU seconds each extra save adds
    for tier in ("local", "durable"):
        done = [r[f"rerun_{tier}"] | timeline(r["local"], r[f"rerun_{tier}"]) for r in reps
                if f"rerun_{tier}" in r and "failed" not in r[f"rerun_{tier}"]]
        out[f"rerun_{tier}"] = {key: median([r.get(key) for r in done]) for key in
                                ("load_seconds", "detect_seconds", "restart_seconds", "kill_to_step_seconds",
                                 "kill_to_caught_up_seconds", "steps_lost", "resumed_step")} | {
            "tier": sorted({r.get("tier") for r in done}, key=str),
            "losses_match": all(r.get("losses_match") for r in done),
            "page_cache_dropped": all(r.get("page_cache_dropped") for r in done)}
        phases: dict[str, list[float]] = {}
        for r in done:
            for name, seconds in r.get("restore_phases", {}).items():
                phases.setdefault(name, []).append(seconds)
        out[f"rerun_{tier}"]["restore_phases"] = {name: median(v) for name, v in phases.items()}
    loads = out["rerun_local"]["load_seconds"], out["rerun_durable"]["load_seconds"]
    out["load_durable_over_local"] = loads[1] / loads[0] if None not in loads and loads[0] else None
    for key in ("local_bytes_at_kill", "durable_checkpoint_bytes"):
        out[key] = median([r.get(key) for r in reps])
    out["local_bytes_peak"] = median([r["local"]["local_bytes_peak"] for r in reps if "local" in r])
    out["commit_wait_before_kill"] = median([r["local"].get("commit_wait") for r in reps if "local" in r])
    return out


def report(ratios: dict, state: int) -> str:
    def s(v, fmt=".3f"):
        return "-" if v is None else format(v, fmt)

    def pct(v):
        return "-" if v is None else f"{100 * v:+.1f}%"

    rate = ratios["steps_per_second"]
    lines = [
        "| measure | value | goal |", "|---|---|---|",
        f"| local step stall (median, s) | {s(ratios['local_stall_seconds'])} | |",
        f"| async durable save stall (median, s) | {s(ratios['durable_stall_seconds'])} | |",
        f"| local stall / durable stall | {s(ratios['stall_local_over_durable'], '.2f')} | <= 1 |",
        f"| steps/s: none / durable every {LOCAL_EVERY} / local every {LOCAL_EVERY} | {s(rate['none'])} / "
        f"{s(rate['durable'])} / {s(rate['local'])} | |",
        f"| tokens/s lost, local every {LOCAL_EVERY} | {pct(ratios['run_overhead_local'])} | <= 3% |",
        f"| tokens/s lost, durable every {LOCAL_EVERY} | {pct(ratios['run_overhead_durable'])} | |",
        f"| CPU s per save, rank 0: local / durable | {s(ratios['cpu_per_save_local'], '.2f')} / "
        f"{s(ratios['cpu_per_save_durable'], '.2f')} | |",
        f"| load durable / load local | {s(ratios['load_durable_over_local'], '.2f')} | >= 3 |",
        f"| before the kill, wait for the local step in flight to commit (s) | "
        f"{s(ratios['commit_wait_before_kill'])} | |",
        f"| local folders at the kill / training state | {s(_over(ratios['local_bytes_at_kill'], state), '.2f')} | |",
        f"| local folders at the peak / training state | {s(_over(ratios['local_bytes_peak'], state), '.2f')} | |",
        "", "| rerun | tier | resumed step | steps lost | load (s) | kill -> exits (s) | relaunch -> step done (s) "
        "| kill -> next step (s) | kill -> the killed step done again (s) | losses as uninterrupted "
        "| page cache dropped |", "|---" * 11 + "|"]
    for tier in ("local", "durable"):
        r = ratios[f"rerun_{tier}"]
        lines.append(f"| from the {tier} tier | {', '.join(map(str, r['tier']))} | {s(r['resumed_step'], 'g')} | "
                     f"{s(r['steps_lost'], 'g')} | {s(r['load_seconds'])} | {s(r['detect_seconds'], '.2f')} | "
                     f"{s(r['restart_seconds'], '.2f')} | {s(r['kill_to_step_seconds'], '.2f')} | "
                     f"{s(r['kill_to_caught_up_seconds'], '.2f')} | "
                     f"{'yes' if r['losses_match'] else 'no'} | {'yes' if r['page_cache_dropped'] else 'no'} |")
    lines.append("")
    for tier in ("local", "durable"):
        phases = ratios[f"rerun_{tier}"]["restore_phases"]
        lines.append(f"restore phases, from the {tier} tier (rank 0, s): "
                     + (", ".join(f"{name} {seconds:.3f}" for name, seconds in phases.items()) or "-"))
    return "\n".join(lines)


def _over(value: float | None, state: int) -> float | None:
    return None if value is None else value / state


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=1.0, help="training state (fp32 weights + AdamW)")
    parser.add_argument("--kill-after", type=int, default=17, help="node 1 is killed after this step (odd: "
                        "after a local step, before the next)")
    parser.add_argument("--durable-every", type=int, default=10, help="durable checkpoints every N steps")
    parser.add_argument("--reps", type=int, default=1, help="repetitions of the five runs")
    parser.add_argument("--local-root", type=Path, default=Path("/dev/shm") if Path("/dev/shm").is_dir() else None,
                        help="where the two node-local folders go (default /dev/shm)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds a launch may take")
    parser.add_argument("--no-drop-cache", dest="drop_cache", action="store_false",
                        help="keep the page cache before the reruns (the default drops it, as root)")
    parser.add_argument("--durable-store", choices=("disk", "s3"), default="disk", help="the durable tier: a "
                        "folder under --out (disk) or an object store (s3: a SeaweedFS server started on loopback, "
                        "or --endpoint)")
    parser.add_argument("--endpoint", default=None, help="with --durable-store s3: an S3 endpoint (credentials from "
                        "the AWS variables) instead of a local SeaweedFS")
    parser.add_argument("--bucket", default=None, help="with --endpoint: an existing bucket (default: bench)")
    parser.add_argument("--small", action="store_true", help="a tiny model and few steps, the page cache kept "
                        "(checks the tool)")
    parser.add_argument("--json", type=Path, default=None, help="write the ratios and raw numbers here")
    parser.add_argument("--out", type=Path, default=None, help="folder for the runs (default: a temporary one)")
    parser.add_argument("--from-json", type=Path, default=None, help="report the runs an earlier --json holds "
                        "(runs nothing)")
    args = parser.parse_args(argv)
    args.hidden, args.intermediate, args.heads = HIDDEN, INTERMEDIATE, HEADS
    args.layers = layers_for(args.size_gb, args.hidden, args.intermediate)
    if args.small:
        args.hidden, args.intermediate, args.heads = SMALL["hidden"], SMALL["intermediate"], SMALL["heads"]
        args.layers, args.kill_after, args.durable_every = SMALL["layers"], SMALL["kill_after"], SMALL["durable_every"]
        args.reps, args.drop_cache = 1, False
    newest_durable = args.kill_after // args.durable_every * args.durable_every
    if args.kill_after % LOCAL_EVERY != 1 or args.kill_after - 1 <= newest_durable:
        parser.error(f"--kill-after {args.kill_after}: needs an odd step whose previous step is a local step newer "
                     f"than the newest durable checkpoint (step {newest_durable} with --durable-every "
                     f"{args.durable_every})")
    if args.from_json:  # the runs of an earlier --json, reported again
        saved = json.loads(args.from_json.read_text())
        args.kill_after, reps, facts = saved["kill_after"], saved["runs"], {k: saved.get(k) for k in FACTS}
    else:
        reps, facts = measure(args)
    ratios = summary(reps, args)
    print(report(ratios, facts["state_bytes"]))
    out = ratios | facts | {"runs": reps}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
        print(f"json: {args.json}")
    failed = [run["failed"] for rep in reps for run in rep.values() if isinstance(run, dict) and "failed" in run]
    for tail in failed:
        print(tail, file=sys.stderr)
    if failed:
        raise SystemExit(1)
    return out


FACTS = ("durable_store", "state_bytes", "layers", "kill_after", "durable_every", "local_every", "reps", "cpu_count",
         "torch", "load_average_before", "load_average")


def measure(args) -> tuple[list[dict], dict]:
    """Every repetition's runs, and the facts of the setup (``FACTS``)."""
    work = args.out or Path(tempfile.mkdtemp(prefix="bench_recovery_"))
    work.mkdir(parents=True, exist_ok=True)
    local_root = Path(tempfile.mkdtemp(prefix="bench_recovery_", dir=args.local_root))
    from automodel_ckpt.models.tiny import ensure_tiny_base

    base = ensure_tiny_base(work / "tiny_llama_base")  # its tokenizer; the model is built from the config above
    import torch

    state = _state_bytes(args.hidden, args.intermediate, args.layers)
    before = os.getloadavg()
    print(f"state: {state / 1e9:.3f} GB (weights + AdamW, {args.layers} layers), 2 nodes x 1 process, "
          f"{args.kill_after + 1} steps, durable every {args.durable_every}, local every {LOCAL_EVERY}, node 1 killed "
          f"after step {args.kill_after}; node-local folders in {local_root}; torch {torch.__version__}, "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load average {before[0]:.1f}",
          flush=True)
    store = ObjectStore(work, args.endpoint, args.bucket) if args.durable_store == "s3" else None
    runs = Runs(work, local_root, base, args, store)
    reps = []
    try:
        for number in range(args.reps):
            rep = one_repetition(runs, args)
            reps.append(rep)
            print(f"repetition {number + 1}: " + ", ".join(
                f"{k} {'failed' if 'failed' in v else 'done'} ({v['wall']:.0f} s)"
                for k, v in rep.items() if isinstance(v, dict) and "wall" in v), flush=True)
    finally:
        shutil.rmtree(local_root, ignore_errors=True)
        if store is not None:
            store.stop()
        if not args.out:
            shutil.rmtree(work, ignore_errors=True)
    facts = {"durable_store": args.durable_store, "state_bytes": state, "layers": args.layers,
             "kill_after": args.kill_after, "durable_every": args.durable_every, "local_every": LOCAL_EVERY,
             "reps": args.reps, "cpu_count": os.cpu_count(), "torch": torch.__version__,
             "load_average_before": before, "load_average": os.getloadavg()}
    return reps, facts

if __name__ == "__main__":
    main()
