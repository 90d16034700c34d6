"""Where a run's checkpoint CPU goes, part by part, from a py-spy profile of the whole run (every process).

    py-spy record --subprocesses --threads --format raw --rate 100 -o run.raw -- ckpt-train ... recipe.yaml
    python tools/save_parts.py run.raw [--saves N] [--ranks R]

``bench_async.py --profile DIR`` records such a profile of each run and prints this table for it. Each sample (a
thread seen on a CPU, not waiting) is put in one part by the innermost frame of its stack that names one:

* ``snapshot``: the live state copied into the save's host buffers (``capture``, ``HostStager``, tensor copies);
* ``serialization``: tensors and objects made into bytes (``torch.save`` records, pickles, the ``.metadata``);
* ``checksums``: hashing (as the bytes are written, or a file read back by the manifest);
* ``write``: the bytes handed to the kernel (``pwrite``, the O_DIRECT buffers filled, small files);
* ``fsync``: ``fsync`` of files and folders;
* ``manifest``: the manifest built and written (its hashing counts in ``checksums``);
* ``publish``: the commit (rename, pointers) and ``retention``: older checkpoints removed;
* ``coordination``: the save's collectives (plans, write results and failure flags gathered, checksums, barriers);
* ``save, other``: the rest of the save (its calls on the training thread, bookkeeping);
* ``training``: every sample of the training thread outside a save, and the threads that are not the save's.

A thread waiting in C on a queue or a lock (the background thread between saves, an idle pool's workers) is left
out, as py-spy's own idle check misses them. CPU seconds are samples over the rate; with ``--saves`` and
``--ranks``, per checkpoint and rank.
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: (part, pattern of a frame's function name); the innermost frame that matches decides
RULES = (
    ("coordination", re.compile(r"all_gather|^gather|scatter|broadcast|barrier|all_reduce|collectively")),
    ("checksums", re.compile(r"_Hasher|hash_file|_hash_share|hexdigest|xxh|crc32")),
    ("fsync", re.compile(r"fsync")),
    ("write", re.compile(r"_pwrite_all|fill_and_write|start_writeback|write_files|write_bytes|write_text|"
                         r"_write_direct|^write_file$")),
    ("serialization", re.compile(r"torch_save|_pt_bytes|dumps|^save$|_save_to|metapickle|_pickled|persistent_id|"
                                 r"^body$|_chunks|_storage")),
    ("snapshot", re.compile(r"capture|HostStager|stage|copy_|_taken|clone")),
    ("retention", re.compile(r"prune|rmtree|retention")),
    ("manifest", re.compile(r"seal|build_manifest|manifest")),
    ("publish", re.compile(r"commit|publish|pointer")),
)
#: innermost frames of a thread waiting in C (a queue, a lock, a condition) that py-spy still reports as running
IDLE = re.compile(r"^(BackgroundThread\._serve|_worker|Condition\.wait|Event\.wait|Thread\._wait_for_tstate_lock|"
                  r"Thread\.join|select|SimpleQueue\.get|Queue\.get)$")
#: frames that say a sample of the training thread is inside a save call
IN_SAVE = re.compile(r"save_checkpoint|write_checkpoint|Checkpointer\.save|fence")
#: the threads a save starts (the background thread, its writer, hashing and fsync pools)
SAVE_THREADS = re.compile(r"ckpt-")
PARTS = ("snapshot", "serialization", "checksums", "write", "fsync", "manifest", "publish", "retention",
         "coordination", "save, other", "training")


def _fsync_lines() -> set[tuple[str, int]]:
    """(file name, line) of every ``fsync(`` call in the package: a sample there is waiting on ``fsync``."""
    out = set()
    for path in (REPO / "automodel_ckpt").rglob("*.py"):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if "fsync(" in line and not line.lstrip().startswith(("def ", "#")):
                out.add((path.name, number))
    return out


def classify(stack: list[str], thread: str, fsync_lines: set[tuple[str, int]]) -> str:
    """The part one sample's ``stack`` (outermost first, ``name (file:line)``) belongs to."""
    ours = bool(SAVE_THREADS.match(thread))
    if not ours and not any(IN_SAVE.search(frame) for frame in stack):
        return "training"
    for frame in reversed(stack):
        name, _, where = frame.partition(" (")
        file, _, line = where.rstrip(")").rpartition(":")
        if line.isdigit() and (Path(file).name, int(line)) in fsync_lines:
            return "fsync"
        for part, pattern in RULES:
            if pattern.search(name.rsplit(".", 1)[-1]) or pattern.search(name):
                return part
    return "save, other"


def parts(raw: Path, rate: float = 100.0) -> dict[str, float]:
    """CPU seconds per part in a py-spy raw profile (``--threads``: each stack starts with its process and thread)."""
    fsync_lines, seconds = _fsync_lines(), collections.Counter()
    for line in raw.read_text().splitlines():
        stack_text, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        frames = stack_text.split(";")
        while frames and frames[0].startswith("process "):  # the process, below its parents (--subprocesses)
            frames.pop(0)
        thread = frames.pop(0).partition(": ")[2] if frames and frames[0].startswith("thread ") else ""
        if frames and IDLE.match(frames[-1].partition(" (")[0]):
            continue
        seconds[classify(frames, thread, fsync_lines)] += int(count) / rate
    return {part: seconds.get(part, 0.0) for part in PARTS}


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("raw", type=Path)
    parser.add_argument("--rate", type=float, default=100.0, help="py-spy's --rate")
    parser.add_argument("--saves", type=int, default=1, help="divide by this many checkpoints")
    parser.add_argument("--ranks", type=int, default=1, help="and by this many ranks")
    args = parser.parse_args(argv)
    found = parts(args.raw, args.rate)
    scale = args.saves * args.ranks
    for part, value in found.items():
        print(f"{part:14s} {value / scale:8.4f} CPU s")
    return found


if __name__ == "__main__":
    main()
