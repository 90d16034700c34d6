"""A run's logs read within bounds: training.jsonl and validation.jsonl sampled, events.jsonl streamed once.

A log up to ``WHOLE_LIMIT`` bytes is read whole and thinned to ``MAX_POINTS`` records; a larger one is read at
``MAX_POINTS`` evenly spaced offsets, ``PROBE`` bytes each. Events keep at most ``MAX_KEPT`` records of each kind.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from automodel_ckpt.errors import UserError, first_line
from automodel_ckpt.ondisk import MiB, RunFolder, is_count, open_regular
from automodel_ckpt.tracking import iter_events, summarize
from automodel_ckpt.training.metrics import log_lines

MAX_POINTS = 1000
WHOLE_LIMIT = 16 * MiB
PROBE = 16 * 1024
MAX_KEPT = 10_000


def records(path: Path) -> tuple[list[dict[str, Any]], str | None]:
    """At most ``MAX_POINTS`` records (JSON objects with a step) of the log at ``path``, in file order, and a note
    when they are a sample of it."""
    try:
        with os.fdopen(open_regular(Path(path)), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > WHOLE_LIMIT:
                got = [r for i in range(MAX_POINTS) if (r := _probe(f, i * size // MAX_POINTS)) is not None]
                return got, (f"{Path(path).name} is {size / MiB:.0f} MiB: {len(got)} records read at evenly "
                             "spaced places")
    except FileNotFoundError:
        return [], None
    except OSError as exc:
        raise UserError(f"cannot read the log '{path}': {first_line(exc)}; logs are read only as regular files") \
            from None
    got = [r for line in log_lines(Path(path)) if (r := _parsed(line)) is not None]
    if len(got) <= MAX_POINTS:
        return got, None
    every = -(-len(got) // MAX_POINTS)
    return got[::every] + ([got[-1]] if (len(got) - 1) % every else []), f"{len(got)} records, every {every}th shown"


def _probe(f: Any, offset: int) -> dict[str, Any] | None:
    """The first whole line after ``offset`` (the line at 0 itself), within ``PROBE`` bytes."""
    f.seek(offset)
    chunk = f.read(PROBE)
    if offset:
        chunk = chunk.partition(b"\n")[2]
    line, newline, _ = chunk.partition(b"\n")
    return _parsed(line.decode("utf-8", "replace")) if newline else None


def _parsed(line: str) -> dict[str, Any] | None:
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return record if isinstance(record, dict) and is_count(record.get("step")) else None


@dataclass
class Events:
    """What the report shows of events.jsonl: each save's record by step, each launch's start, ``auto``'s
    interval decisions, and the run's costs (``summarize``)."""

    saves: dict[int, dict[str, Any]] = field(default_factory=dict)
    starts: list[dict[str, Any]] = field(default_factory=list)
    intervals: list[dict[str, Any]] = field(default_factory=list)
    costs: Any = None


def events(run_dir: Path) -> Events:
    out = Events()

    def kept() -> Iterator[dict[str, Any]]:
        for record in iter_events(Path(run_dir)):
            event, step = record.get("event"), record.get("step")
            if event == "checkpoint" and is_count(step) and (step in out.saves or len(out.saves) < MAX_KEPT):
                out.saves[step] = record
            elif event == "start" and len(out.starts) < MAX_KEPT:
                out.starts.append(record)
            elif event == "interval" and len(out.intervals) < MAX_KEPT:
                out.intervals.append(record)
            yield record

    out.costs = summarize(kept())
    return out


def run_logs(run_dir: Path) -> dict[str, Any]:
    """The training and validation records (with notes when sampled) and the events of ``run_dir``."""
    train, train_note = records(RunFolder(run_dir).training_log)
    val, val_note = records(RunFolder(run_dir).validation_log)
    return {"train": train, "val": val, "notes": [n for n in (train_note, val_note) if n], "events": events(run_dir)}
