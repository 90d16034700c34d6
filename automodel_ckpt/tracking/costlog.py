"""What checkpoints cost a run: timed on the training thread, recorded in ``events.jsonl``, summarised for reports.

``events.jsonl`` (rank 0, appended across resumes, never truncated) holds ``start``, ``checkpoint``, ``end`` and
side-work records; a ``start`` with no ``end`` before the next was interrupted (docs/report.md).
"""

from __future__ import annotations

import math
import random
import statistics
import time
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from automodel_ckpt.ondisk import RunFolder, read_manifest, size_on_disk
from automodel_ckpt.training.metrics import JsonlLog, iter_jsonl
from automodel_ckpt.checkpoint import MTBF_LIMIT_HOURS

START, CHECKPOINT, END = "start", "checkpoint", "end"
SIDE_FAILURE = "side_failure"  # side work that failed while training went on (an export, a node-local step...)
BEHIND, CAUGHT_UP = "tracking_behind", "tracking_caught_up"  # a tracker not waited for, and when it caught up


def written_bytes(path: Path) -> int | None:
    """The bytes a checkpoint's save wrote, less what it linked (``linked_bytes``); None where it linked nothing."""
    try:
        table = read_manifest(path) or {}
        linked = table.get("linked_bytes")
        return int(table["total_bytes"]) - int(linked) if linked else None
    except (OSError, ValueError, TypeError, KeyError):
        return None


def checkpoint_bytes(path: Path) -> int | None:
    """The size of a published checkpoint: its manifest's total (every rank's files), else what is on disk."""
    try:
        total = (read_manifest(path) or {}).get("total_bytes")
        return int(total) if total is not None else size_on_disk(path)
    except (OSError, ValueError, TypeError):
        return None


@dataclass
class _InFlight:
    """A save whose background work may still run: completed into a ``checkpoint`` record at the next save."""

    step: int
    path: Path | None
    call_s: float
    returned: float
    job: Any  # overlap.Overlapped
    preemption: bool
    done_at: float | None = None


class CheckpointCosts:
    """Times each save and appends its ``checkpoint`` record (rank 0): blocked, the call plus an async save's wait
    at the next step's fence; background, from the call's return to the publish."""

    def __init__(self, run_dir: Path, *, enabled: bool, on_record: Callable[[dict[str, Any]], None]) -> None:
        self.log = JsonlLog(RunFolder(run_dir).events_log, enabled=enabled)
        self.on_record = on_record
        self._started = time.time()
        self._blocked = 0.0
        self._in_flight: _InFlight | None = None

    def start(self, step: int, resumed_from: str | None, **facts: Any) -> None:
        self._started = time.time()
        self._append({"event": START, "time": self._started, "step": step, "resumed_from": resumed_from, **facts})

    def save(self, save: Callable[[], Path | None], step: int, background: Callable[[], Any], *,
             preemption: bool = False) -> Path | None:
        """Run ``save`` (the checkpointer's save), timing it; ``background()``: the async job it left, or None."""
        t0 = time.perf_counter()
        path = save()
        returned = time.perf_counter()
        self._complete_in_flight(0.0, step)  # the save above waited for the previous one: it is published now
        job = background()
        flight = _InFlight(step, path, returned - t0, returned, job, preemption)
        if job is None:
            self._record(flight, background_s=None, at_step=step)
        else:
            done = job.completed if job.completed is not None else (job.writes[-1] if job.writes else None)
            if done is not None:
                done.add_done_callback(lambda _f, f=flight: setattr(f, "done_at", time.perf_counter()))
            self._in_flight = flight
        return path

    def finalize(self, finalize: Callable[[], Any], step: int) -> Any:
        """Run ``finalize`` (the checkpointer's), adding its time to the save still in flight."""
        t0 = time.perf_counter()
        out = finalize()
        self._complete_in_flight(time.perf_counter() - t0, step)
        return out

    def end(self, step: int, status: str) -> dict[str, Any]:
        record = self.end_record(step, status)
        self._append(record)
        return record

    def end_record(self, step: int, status: str) -> dict[str, Any]:
        """The ``end`` record of this launch, not yet appended (``note`` appends it)."""
        return {"event": END, "time": time.time(), "step": step, "status": status,
                "wall_s": round(time.time() - self._started, 4), "blocked_s": round(self._blocked, 4)}

    def _complete_in_flight(self, extra_blocked: float, at_step: int) -> None:
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return
        done_at = flight.done_at if flight.done_at is not None else time.perf_counter()
        self._record(flight, background_s=max(0.0, done_at - flight.returned), extra_blocked=extra_blocked,
                     at_step=at_step)

    def _record(self, flight: _InFlight, *, background_s: float | None, at_step: int,
                extra_blocked: float = 0.0) -> None:
        """Append ``flight``'s ``checkpoint`` record, logged at ``at_step`` (an async save's waits for the next save,
        and the trackers' steps only increase)."""
        fence = float(getattr(flight.job, "fence_seconds", 0.0) or 0.0)
        blocked = flight.call_s + fence + extra_blocked
        self._blocked += blocked
        size = checkpoint_bytes(flight.path) if flight.path is not None and self.log.enabled else None
        written = written_bytes(flight.path) if size else None
        writing = background_s if background_s is not None else blocked
        now = time.time()
        record = {
            "event": CHECKPOINT, "time": now, "step": flight.step, "at_step": at_step,
            "name": flight.path.name if flight.path is not None else None,
            "blocked_s": round(blocked, 4), "fence_s": round(fence, 4),
            "background_s": None if background_s is None else round(background_s, 4),
            "bytes": size, "written_bytes": size if written is None else written,
            "write_gbps": round(size / writing / 1e9, 4) if size and writing > 0 else None,
            "wall_share": round(self._blocked / max(now - self._started, 1e-9), 6), "preemption": flight.preemption,
        }
        self._append(record)
        self.on_record(record)

    def note(self, record: dict[str, Any]) -> None:
        """Append a record of side work (a tracker behind or caught up, a side failure) to ``events.jsonl``."""
        self._append(record)

    def _append(self, record: dict[str, Any]) -> None:
        try:
            self.log.append(record)
        except OSError as exc:  # the run's own log is side work too: one warning per failure, training goes on
            warnings.warn(f"'{self.log.path}': could not record a {record.get('event')} event ({exc.strerror or exc})",
                          stacklevel=3)


# --- reading a run's costs back ------------------------------------------------------------------


@dataclass
class RunCosts:
    """A run's checkpoint costs as recorded in its ``events.jsonl`` (every launch of it)."""

    launches: int
    interruptions: int  # launches that ended without an ``end`` record and were resumed
    wall_s: float  # summed over launches (an interrupted one: up to its last record)
    steps: int  # optimizer steps trained, summed over launches (steps redone after a resume count again)
    checkpoints: int
    blocked_s: float  # every save and the final wait, summed
    blocked_per_checkpoint_s: float | None
    background_per_checkpoint_s: float | None
    bytes_per_checkpoint: float | None
    write_gbps: float | None  # median of the checkpoints'
    every_steps: int | None  # the run's own interval (step_scheduler.ckpt_every_steps or the median spacing)
    tracking_behind_s: float = 0.0  # while at least one tracker was behind (a failed one: to its launch's end)
    side_failures: int = 0  # side work that failed while training went on
    local_steps_abandoned: int = 0  # node-local steps given up (``local_step`` side failures that abandon one)
    written_per_checkpoint: float | None = None  # bytes a save wrote (less than its size where it linked files)
    #: ``ckpt_every_steps: auto``: how often the interval changed, the last one, and the fixed interval it replaced
    #: (an earlier launch's ``ckpt_every_steps``; else the interval the first launch with ``auto`` started at)
    auto_changes: int | None = None
    auto_every_steps: int | None = None
    replaced_every_steps: int | None = None
    mtbf_hours: float | None = None  # the run's checkpoint.mtbf_hours (its last launch's), when it set one

    @property
    def share(self) -> float:
        return self.blocked_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def step_s(self) -> float | None:
        """Seconds per optimizer step, checkpoints left out."""
        return (self.wall_s - self.blocked_s) / self.steps if self.steps > 0 and self.wall_s > self.blocked_s else None


def iter_events(run_dir: Path) -> Iterator[dict[str, Any]]:
    """The records of a run's ``events.jsonl``, one at a time (``iter_jsonl``)."""
    return iter_jsonl(RunFolder(run_dir).events_log)


def summarize(events: Iterable[dict[str, Any]]) -> RunCosts:
    """The costs of ``events``' launches in bounded memory; a field of the wrong type is left out."""
    launches = interruptions = steps = checkpoints = failures = abandoned = 0
    wall = behind = 0.0
    launch: _Launch | None = None
    blocked, background, sizes, writes = _Mean(), _Mean(), _Mean(), _Mean()
    rates, gaps = _Sample(), _Sample()
    every: int | None = None
    last_save_step: int | None = None
    auto_changes: int | None = None
    auto_every = replaced = mtbf_hours = None
    for record in events:
        if not isinstance(record, dict):
            continue
        event = record.get("event")
        if event == START or launch is None:
            if launch is not None:
                wall, steps, behind = wall + launch.wall, steps + launch.steps, behind + launch.close()
                interruptions += not launch.ended
            launch, launches = _Launch(), launches + 1
        launch.add(record)
        if event == START:  # each launch says its checkpoint.mtbf_hours: the last one's is the run's
            value = finite_number(record.get("mtbf_hours"))
            mtbf_hours = value if value is not None and 0 < value <= MTBF_LIMIT_HOURS else None
        if event == START and record.get("every_steps") == "auto":
            if auto_changes is None:
                auto_changes, replaced, every = 0, every, None  # the spacing of its saves is the run's interval
        elif event == START and _whole(record.get("every_steps")) and record["every_steps"] > 0:
            every = record["every_steps"]
        elif event == "interval" and auto_changes is not None and _whole(record.get("every_steps")):
            auto_changes, auto_every = auto_changes + 1, record["every_steps"]
            if replaced is None and _whole(record.get("was_every_steps")):
                replaced = record["was_every_steps"]
        elif event == CHECKPOINT:
            checkpoints += 1
            for mean, key in ((blocked, "blocked_s"), (background, "background_s"), (sizes, "bytes")):
                value = finite_number(record.get(key))
                if value is not None and (key != "bytes" or value):
                    mean.add(value)
            value = finite_number(record.get("written_bytes", record.get("bytes")))  # before: every byte was written
            if value:
                writes.add(value)
            rate = finite_number(record.get("write_gbps"))
            if rate:
                rates.add(rate)
            step = record.get("step")
            if _whole(step):
                if last_save_step is not None and step > last_save_step:
                    gaps.add(step - last_save_step)
                last_save_step = step
        elif event == SIDE_FAILURE and (record.get("kind") != "local_step" or _abandons(record)):
            failures += 1
            abandoned += record.get("kind") == "local_step"
    if launch is not None:
        wall, steps, behind = wall + launch.wall, steps + launch.steps, behind + launch.close()
    if every is None and gaps.count:
        every = int(gaps.median())
    return RunCosts(
        tracking_behind_s=behind, side_failures=failures, local_steps_abandoned=abandoned,
        written_per_checkpoint=writes.mean(),
        launches=launches, interruptions=interruptions, wall_s=wall, steps=steps, checkpoints=checkpoints,
        blocked_s=blocked.total, blocked_per_checkpoint_s=blocked.mean(), background_per_checkpoint_s=background.mean(),
        bytes_per_checkpoint=sizes.mean(), write_gbps=rates.median() if rates.count else None, every_steps=every,
        auto_changes=auto_changes, auto_every_steps=auto_every, replaced_every_steps=replaced, mtbf_hours=mtbf_hours,
    )


class _Launch:
    """One launch's times, steps, whether it ended, and the seconds at least one tracker was behind."""

    def __init__(self) -> None:
        self.first_time = self.last_time = None  # type: float | None
        self.first_step = self.max_step = None  # type: int | None
        self.ended = False
        self.behind: dict[str, float] = {}  # backend -> since
        self.since: float | None = None  # since when at least one is behind
        self.behind_s = 0.0

    def add(self, record: dict[str, Any]) -> None:
        event, t = record.get("event"), record.get("time")
        self.ended = self.ended or event == END
        if _whole(record.get("step")):
            step = record["step"]
            self.first_step = step if self.first_step is None else self.first_step
            self.max_step = step if self.max_step is None else max(self.max_step, step)
        t = finite_number(t)
        if t is None:
            return
        self.first_time = t if self.first_time is None else min(self.first_time, t)
        self.last_time = t if self.last_time is None else max(self.last_time, t)
        backend = str(record.get("backend"))[:64]
        if event == BEHIND and backend not in self.behind and len(self.behind) < _MAX_BACKENDS:
            if not self.behind:
                self.since = t
            self.behind[backend] = t
        elif event == CAUGHT_UP and self.behind.pop(backend, None) is not None and not self.behind:
            self.behind_s += max(0.0, t - (self.since if self.since is not None else t))
            self.since = None

    @property
    def wall(self) -> float:
        return self.last_time - self.first_time if self.first_time is not None and self.last_time is not None else 0.0

    @property
    def steps(self) -> int:
        return self.max_step - self.first_step if self.first_step is not None and self.max_step is not None else 0

    def close(self) -> float:
        """The launch's seconds behind, a tracker still behind at its end counted to its last record."""
        if self.behind and self.since is not None and self.last_time is not None:
            self.behind_s += max(0.0, self.last_time - self.since)
        return self.behind_s


class _Mean:
    def __init__(self) -> None:
        self.total, self.count = 0.0, 0

    def add(self, value: float) -> None:
        self.total, self.count = self.total + value, self.count + 1

    def mean(self) -> float | None:
        return self.total / self.count if self.count else None


class _Sample:
    """Values for a median: all up to ``KEEP``, then a seeded reservoir sample (the same file, the same report)."""

    KEEP = 1 << 16

    def __init__(self) -> None:
        self.values: list[float] = []
        self.count = 0
        self._random = random.Random(0)

    def add(self, value: float) -> None:
        self.count += 1
        if len(self.values) < self.KEEP:
            self.values.append(value)
        else:
            k = self._random.randrange(self.count)
            if k < self.KEEP:
                self.values[k] = value

    def median(self) -> float:
        return statistics.median(self.values)


_MAX_BACKENDS = 64


def finite_number(value: Any) -> float | None:
    """A finite number of a record, else None (a string, a list, NaN or infinity is left out)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _abandons(record: dict[str, Any]) -> bool:
    """Whether a ``local_step`` side failure abandoned a step."""
    return " abandoned" in str(record.get("text", ""))
