"""Streamed corpora: pipeline throughput vs the trainer's consumption, resume time by position, peak memory by size.

    python tools/bench_data.py [--small-mb 200] [--big-mb 2000] [--files 64] [--seconds 20] [--out DIR]
    python tools/bench_data.py --lanes [--lanes-mb 16] [--steps 400] [--sizes 1,4,16,64] [--workers 0,1,2]

``--lanes``: rank 0 of N data-parallel ranks (``data.lanes`` 64, global batch 64, ``seq_length`` 64) at each N and
``num_workers``, each in a fresh process: CPU seconds (the process and its workers) per sequence it delivers after
its first step, bytes it reads (counted where its readers open files, first step included), its sequences per
second and N times that (all readers together, each rank on its own cores), and, with no workers, the time from a
checkpointed position at 1% and at 90% of the corpus to the first batch.

Writes a generated json-lines corpus of ``--big-mb`` (and one of ``--small-mb``) in ``--files`` files under
``--out`` (deleted at the end unless ``--keep``), tokenized by the embedded tiny base's tokenizer, and measures,
each in a fresh process so that its peak memory is its own:

* ``pipeline``: one rank's ``StreamLoader`` (2 data-parallel ranks, ``data.num_workers`` 2, the tiny pretraining
  recipe's batch and ``seq_length``) handing out steps as fast as it can: tokens per second for that rank;
* ``trainer``: ``ckpt-train`` on 2 processes with the tiny pretraining recipe over the same corpus: the tokens per
  second the training loop consumes (median step, per rank);
* ``resume``: the time from a checkpointed position to the first sequence, at 1% and at 90% of the corpus;
* ``memory``: peak resident memory of one reader making the same number of sequences from the small and the big
  corpus.

Prints a Markdown table (docs/benchmarks.md has the one measured on the machine it names) and writes
``DIR/bench_data.json``. Not a test: it takes minutes.

Times internals: imports ``data.stream`` (the stream's readers and loader) directly.
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

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "tiny_llama_pretrain.yaml"
TARGET = "automodel_ckpt.data.stream.corpus.streamed_corpus"


def write_corpus(folder: Path, megabytes: int, files: int) -> Path:
    """``files`` json-lines files of generated documents, ``megabytes`` in all (one block of documents repeated)."""
    import random

    from automodel_ckpt.data.stream.generated import _document

    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    block = "".join(json.dumps({"text": _document(rng)}) + "\n" for _ in range(20000)).encode()
    per_file = megabytes * 2**20 // files
    for f in range(files):
        with open(folder / f"part-{f:05d}.jsonl", "wb") as out:
            written = 0
            while written < per_file:
                chunk = block[: per_file - written]
                cut = chunk.rfind(b"\n") + 1  # whole lines only
                if cut == 0:
                    break
                out.write(chunk[:cut])
                written += cut
    return folder


def _tokenizer(assets: Path):
    from automodel_ckpt.models.build import build_tokenizer
    from automodel_ckpt.models.tiny import ensure_tiny_base

    ensure_tiny_base(assets / "tiny_llama_base")
    return build_tokenizer(str(assets / "tiny_llama_base"))


def _settings(shuffle_buffer: int = 1000):
    from automodel_ckpt.data.stream.stream import StreamSettings

    return StreamSettings(seq_length=64, seed=42, shuffle_buffer=shuffle_buffer)


def child_pipeline(corpus: str, assets: str, seconds: float) -> dict:
    from automodel_ckpt.data.stream.corpus import streamed_corpus
    from automodel_ckpt.data.stream.loader import StreamLoader

    c = streamed_corpus(path=corpus)
    loader = StreamLoader(c, c.list_shards(), _tokenizer(Path(assets)), _settings(), global_batch_size=32,
                          local_batch_size=16, dp_rank=0, dp_size=2, num_workers=2)
    loader.next_batch()  # workers started, buffers filled
    t0, tokens = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        _, micro = loader.next_batch()
        tokens += sum(mb.input_ids.numel() for mb in micro)
    return {"rank_tokens_per_sec": tokens / (time.perf_counter() - t0)}


def _position_at(c, shards, tok, fraction: float) -> dict:
    """A real position about ``fraction`` into the corpus: a stream started at that shard, run until its shuffle
    buffer is full and a batch of documents drawn."""
    from automodel_ckpt.data.stream.stream import POSITION_VERSION, GlobalStream

    n = len(shards[0])
    start = {"version": POSITION_VERSION, "sources": [{
        "shards": [s.record() for s in shards[0]], "epoch": 0, "n": n, "pos": min(int(fraction * n), n - 1),
        "key": 0, "row": 0, "seen": 0, "epoch_rows": 1, "taken": 0, "tokens": 0, "buffer_shards": [],
        "buffer_keys": []}], "docs": 0, "pending": [], "offset": 0, "sequences": 0, "skipped": 0, "epoch": 0}
    stream = GlobalStream(c, shards, tok, _settings(), start)
    for _ in range(200):
        stream.next_sequence()
    return stream.position()


def child_resume(corpus: str, assets: str) -> dict:
    from automodel_ckpt.data.stream.corpus import streamed_corpus
    from automodel_ckpt.data.stream.stream import GlobalStream

    c = streamed_corpus(path=corpus)
    shards, tok = c.list_shards(), _tokenizer(Path(assets))
    out = {}
    for fraction in (0.01, 0.9):
        position = _position_at(c, shards, tok, fraction)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            listed = c.list_shards()  # a resume lists the corpus (its identity) ...
            GlobalStream(c, listed, tok, _settings(), position).next_sequence()  # ... and reads back its references
            times.append(time.perf_counter() - t0)
        out[f"resume_seconds_{int(fraction * 100)}pct"] = statistics.median(times)
    return out


class _Counted:
    """A file whose reads are counted into a shared counter (the readers' workers are forked: the counter is theirs
    too)."""

    def __init__(self, f, counter) -> None:
        self.f, self.counter = f, counter

    def read(self, n=-1):
        data = self.f.read(n)
        with self.counter.get_lock():
            self.counter.value += len(data)
        return data

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()

    def __iter__(self):
        return iter(self.f)


def _lanes_loader(c, tok, dp: int, workers: int, lanes: int = 64, gbs: int = 64):
    from automodel_ckpt.data.stream.loader import StreamLoader

    return StreamLoader(c, c.list_shards(lanes=lanes), tok, _settings(), global_batch_size=gbs,
                        local_batch_size=gbs // dp, dp_rank=0, dp_size=dp, num_workers=workers, lanes=lanes,
                        log_ids=False)


def child_lanes(corpus: str, assets: str, dp: int, workers: int, steps: int) -> dict:
    """Rank 0 of ``dp`` with ``workers`` workers for ``steps`` steps: CPU, bytes read, sequences per second."""
    import gc
    import multiprocessing

    from automodel_ckpt.data.stream import readers
    from automodel_ckpt.data.stream.corpus import streamed_corpus

    counter = multiprocessing.Value("q", 0)
    real_open = readers._open
    readers._open = lambda *a, **k: _Counted(real_open(*a, **k), counter)
    c = streamed_corpus(path=corpus)
    tok = _tokenizer(Path(assets))
    loader = _lanes_loader(c, tok, dp, workers)
    loader.next_batch()  # started: workers forked, lanes opened, buffers filled (not counted)
    pids = _children()  # the loader's DataLoader workers
    cpu0, wall0 = time.process_time() + sum(_proc_cpu(p) for p in pids), time.perf_counter()
    delivered = 0
    for _ in range(steps):
        _, micro = loader.next_batch()
        delivered += sum(len(mb.input_ids) for mb in micro)
    wall = time.perf_counter() - wall0
    cpu = time.process_time() + sum(_proc_cpu(p) for p in pids) - cpu0
    loader._iter = None
    gc.collect()
    return {"dp": dp, "workers": workers, "sequences": delivered, "cpu_seconds": cpu, "wall_seconds": wall,
            "bytes_read": counter.value, "lanes_read": len(loader.my_lanes), "workers_started": loader.num_workers}


def _children() -> list[int]:
    """The pids of this process's children (Linux /proc)."""
    tasks = Path(f"/proc/{os.getpid()}/task")
    return [int(p) for t in tasks.iterdir() for p in (t / "children").read_text().split()]


def _proc_cpu(pid: int) -> float:
    """CPU seconds (user and system) of process ``pid`` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _lanes_state(c, tok, fraction: float, lanes: int = 64, per_lane: int = 4) -> dict:
    """A real loader state with every lane about ``fraction`` into its share of the corpus: each lane started at
    that place of its unit order and run ``per_lane`` sequences (``per_lane * lanes`` sequences in all)."""
    from automodel_ckpt.data.stream.position import LANES_VERSION, lane_counts
    from automodel_ckpt.data.stream.stream import POSITION_VERSION, GlobalStream

    shards = c.list_shards(lanes=lanes)
    n = len(shards[0])
    positions, counts = {}, {}
    for lane in range(lanes):
        mine = len(range(lane, n, lanes)) if n >= lanes else 1
        start = {"version": POSITION_VERSION, "sources": [{
            "epoch": 0, "n": n, "pos": min(int(fraction * mine), mine - 1), "key": 0, "row": 0, "seen": 0,
            "epoch_rows": 1, "taken": 0, "tokens": 0, "buffer_shards": [], "buffer_keys": []}], "docs": 0,
            "pending": [], "offset": 0, "sequences": 0, "skipped": 0, "epoch": 0}
        stream = GlobalStream(c, shards, tok, _settings(), start, lane, lanes)
        for _ in range(per_lane):
            stream.next_sequence()
        positions[lane], counts[lane] = stream.position(shards=False), lane_counts(stream)
    return {"kind": "stream", "version": LANES_VERSION, "lanes": lanes, "sequences": per_lane * lanes,
            "shards": [[s.record() for s in src] for src in shards], "positions": positions, "counts": counts}


def child_lanes_resume(corpus: str, assets: str, dp: int) -> dict:
    from automodel_ckpt.data.stream.corpus import streamed_corpus

    c = streamed_corpus(path=corpus)
    tok = _tokenizer(Path(assets))
    out = {}
    for fraction in (0.01, 0.9):
        state = _lanes_state(c, tok, fraction)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            loader = _lanes_loader(c, tok, dp, 0)  # a resume lists the corpus (its identity) ...
            loader.load_state_dict(state)
            loader.next_batch()  # ... reads back its lanes' references and makes the first batch
            times.append(time.perf_counter() - t0)
        out[f"resume_seconds_{int(fraction * 100)}pct"] = statistics.median(times)
    return out


def lanes_bench(work: Path, megabytes: int, files: int, steps: int, sizes: list[int], workers: list[int],
                repeat: int = 1) -> None:
    """``--lanes``: the table of docs/benchmarks.md's "Lanes" section."""
    assets = work / "assets"
    _tokenizer(assets)
    folder = write_corpus(work / "lanes", megabytes, files)
    pattern = str(folder / "*.jsonl")
    corpus_bytes = sum(f.stat().st_size for f in folder.iterdir())
    rows = []
    for dp in sizes:
        for w in workers:
            runs = [_child("lanes", pattern, str(assets), str(dp), str(w), str(steps)) for _ in range(repeat)]
            r = min(runs, key=lambda x: x["cpu_seconds"])  # the least disturbed of the runs (a shared machine)
            r["wall_seconds"] = min(x["wall_seconds"] for x in runs)
            if w == 0:
                r |= _child("lanes_resume", pattern, str(assets), str(dp))
            rows.append(r)
    results = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
               "corpus_bytes": corpus_bytes, "files": files, "steps": steps, "rows": rows}
    (work / "bench_lanes.json").write_text(json.dumps(results, indent=2))
    print(f"corpus {corpus_bytes / 2**20:.1f} MiB in {files} files, {steps} steps of 64 sequences of 64 tokens, "
          "64 lanes; rank 0 of N")
    print("| N | workers (started) | lanes read | sequences | CPU s / 1k sequences | bytes read | sequences/s | all N readers, "
          "sequences/s | resume at 1% / 90% |\n|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        resume = (f"{r['resume_seconds_1pct']:.3f} s / {r['resume_seconds_90pct']:.3f} s"
                  if "resume_seconds_1pct" in r else "")
        rate = r["sequences"] / r["wall_seconds"]
        print(f"| {r['dp']} | {r['workers']} ({r['workers_started']}) | {r['lanes_read']} | {r['sequences']} | "
              f"{1000 * r['cpu_seconds'] / r['sequences']:.3f} | {r['bytes_read'] / 2**20:.2f} MiB | {rate:,.0f} | "
              f"{rate * r['dp']:,.0f} | {resume} |")


def child_memory(corpus: str, assets: str, sequences: int) -> dict:
    from automodel_ckpt.data.stream.corpus import streamed_corpus
    from automodel_ckpt.data.stream.stream import GlobalStream

    c = streamed_corpus(path=corpus)
    stream = GlobalStream(c, c.list_shards(), _tokenizer(Path(assets)), _settings())
    for _ in range(sequences):
        stream.next_sequence()
    return {"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _child(kind: str, *args: str) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", kind, *args], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    if done.returncode:
        raise SystemExit(f"{kind} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def trainer(corpus: str, assets: Path, work: Path, steps: int, streamed: bool = True) -> dict:
    """The tiny pretraining recipe on 2 processes over ``corpus``: streamed (2 workers per rank), or the same
    files tokenized up front and packed (``load_local_dataset``): median step time and tokens per second per rank."""
    env = {**os.environ, "AUTOMODEL_CKPT_ASSETS": str(assets), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(work / "hf_datasets")}
    run = work / ("trainer" if streamed else "trainer_pretokenized")
    data = (["--dataset._target_", TARGET, "--dataset.path", corpus, "--data.num_workers", "2"] if streamed else
            ["--dataset._target_", "automodel_ckpt.data.files.load_local_dataset", "--dataset.path", corpus,
             "--data.packing", "true", "--data.val_size", "0"])
    cmd = [str(Path(sys.executable).parent / "ckpt-train"), "--nproc-per-node", "2", str(RECIPE),
           "--training.progress_bar", "false", *data, "--validation_dataset", "null", "--step_scheduler.max_steps",
           str(steps), "--checkpoint.enabled", "false", "--checkpoint.checkpoint_dir", str(run)]
    done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"trainer failed:\n{done.stderr[-3000:]}")
    records = [json.loads(x) for x in (run / "training.jsonl").read_text().splitlines()][5:]  # warm steps only
    global_rate = statistics.median(r["tokens_per_sec"] for r in records)
    suffix = "" if streamed else "_pretokenized"
    out = {f"trainer_tokens_per_sec_per_rank{suffix}": global_rate / 2, f"trainer_step_seconds{suffix}":
           statistics.median(r["step_seconds"] for r in records)}
    if streamed:  # how long rank 0's steps waited for their batch (steady state: the workers are ahead)
        out["data_wait_seconds_median"] = statistics.median(r["data_wait_seconds"] for r in records)
        out["data_wait_seconds_max"] = max(r["data_wait_seconds"] for r in records)
    return out


def step_time_only(work: Path, steps: int) -> None:
    """``--step-time``: the tiny recipe's step, streamed vs tokenized up front, over the same 8 MB of files."""
    assets = work / "assets"
    _tokenizer(assets)
    folder = write_corpus(work / "pre", 8, 8)
    results = trainer(str(folder / "*.jsonl"), assets, work, steps) | trainer(str(folder), assets, work, steps, False)
    (work / "bench_data_step.json").write_text(json.dumps(results, indent=2))
    print(f"| step time, streamed / tokenized up front | {results['trainer_step_seconds']:.3f} s / "
          f"{results['trainer_step_seconds_pretokenized']:.3f} s "
          f"({results['trainer_step_seconds'] / results['trainer_step_seconds_pretokenized']:.2f}x) |\n"
          f"| a streamed step's wait for its batch, median / max | {results['data_wait_seconds_median'] * 1e3:.2f} ms"
          f" / {results['data_wait_seconds_max'] * 1e3:.2f} ms |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small-mb", type=int, default=200)
    ap.add_argument("--big-mb", type=int, default=2000)
    ap.add_argument("--files", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--sequences", type=int, default=20000)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--step-time", action="store_true", help="only the step time, streamed vs tokenized up front")
    ap.add_argument("--lanes", action="store_true", help="only rank 0 of N over lanes (CPU, bytes, rate, resume)")
    ap.add_argument("--lanes-mb", type=int, default=16)
    ap.add_argument("--sizes", default="1,4,16,64")
    ap.add_argument("--workers", default="0,1,2")
    ap.add_argument("--repeat", type=int, default=1, help="--lanes: runs of each, the least CPU kept")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, *rest = args.child
        result = {"lanes": lambda: child_lanes(rest[0], rest[1], int(rest[2]), int(rest[3]), int(rest[4])),
                  "lanes_resume": lambda: child_lanes_resume(rest[0], rest[1], int(rest[2])),
                  "pipeline": lambda: child_pipeline(rest[0], rest[1], float(rest[2])),
                  "resume": lambda: child_resume(rest[0], rest[1]),
                  "memory": lambda: child_memory(rest[0], rest[1], int(rest[2]))}[kind]()
        print(json.dumps(result))
        return
    work = args.out or Path(tempfile.mkdtemp(prefix="bench-data-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.step_time:
        step_time_only(work, args.steps)
        return
    if args.lanes:
        lanes_bench(work, args.lanes_mb, args.files, args.steps, [int(x) for x in args.sizes.split(",")],
                    [int(x) for x in args.workers.split(",")], args.repeat)
        return
    assets = work / "assets"
    _tokenizer(assets)
    small = write_corpus(work / "small", args.small_mb, args.files)
    big = write_corpus(work / "big", args.big_mb, args.files)
    results: dict = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
                     "small_mb": args.small_mb, "big_mb": args.big_mb, "files": args.files}
    results |= _child("pipeline", str(big / "*.jsonl"), str(assets), str(args.seconds))
    results |= trainer(str(big / "*.jsonl"), assets, work, args.steps)
    results |= _child("resume", str(big / "*.jsonl"), str(assets))
    results["peak_rss_mib_small"] = _child("memory", str(small / "*.jsonl"), str(assets), str(args.sequences))["peak_rss_mib"]
    results["peak_rss_mib_big"] = _child("memory", str(big / "*.jsonl"), str(assets), str(args.sequences))["peak_rss_mib"]
    (work / "bench_data.json").write_text(json.dumps(results, indent=2))
    ratio = results["rank_tokens_per_sec"] / results["trainer_tokens_per_sec_per_rank"]
    print(f"| measure | value |\n|---|---|\n"
          f"| pipeline, one rank (2 workers) | {results['rank_tokens_per_sec']:,.0f} tokens/s |\n"
          f"| trainer consumption, per rank | {results['trainer_tokens_per_sec_per_rank']:,.0f} tokens/s "
          f"({results['trainer_step_seconds']:.3f} s/step) |\n"
          f"| pipeline / trainer | {ratio:.1f}x |\n"
          f"| resume to first sequence at 1% / 90% | {results['resume_seconds_1pct']:.3f} s / "
          f"{results['resume_seconds_90pct']:.3f} s ({results['resume_seconds_90pct'] / results['resume_seconds_1pct']:.2f}x) |\n"
          f"| peak memory, {args.small_mb} MB / {args.big_mb} MB corpus | {results['peak_rss_mib_small']:.0f} MiB / "
          f"{results['peak_rss_mib_big']:.0f} MiB |")
    if not args.keep and args.out is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
