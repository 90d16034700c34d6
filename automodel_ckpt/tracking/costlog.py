"""What checkpoints cost a run: timed on the training thread, recorded in ``events.jsonl``, summarised for reports.

``events.jsonl`` (rank 0, in the run folder, appended across every resume, never truncated) holds one line per
event: ``start`` (each launch: the step it starts from, the checkpoint it resumed from), ``checkpoint`` (each save:
the seconds the training thread was blocked, the background seconds, the bytes, the write rate) and ``end`` (a run
that finished or was preempted). A launch with no ``end`` followed by another ``start`` was interrupted. Side work
adds ``tracking_behind`` / ``tracking_caught_up`` (a tracker no longer waited for, and when it had caught up) and
``side_failure`` (an export, a node-local step... that failed while training went on).
"""

from __future__ import annotations

import statistics
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from automodel_ckpt.ondisk import catalog, layout, manifest
from automodel_ckpt.training.metrics import JsonlLog, read_jsonl

START, CHECKPOINT, END = "start", "checkpoint", "end"
SIDE_FAILURE = "side_failure"  # side work that failed while training went on (an export, a node-local step...)
BEHIND, CAUGHT_UP = "tracking_behind", "tracking_caught_up"  # a tracker not waited for, and when it caught up


def checkpoint_bytes(path: Path) -> int | None:
    """The size of a published checkpoint: its manifest's total (every rank's files), else what is on disk."""
    try:
        total = (manifest.read(path) or {}).get("total_bytes")
        return int(total) if total is not None else catalog.size_on_disk(path)
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
    """Times each save on the training thread and appends its ``checkpoint`` record (rank 0 writes).

    Sync save: blocked = the save call. Async save: blocked = the save call plus the time the next optimizer step
    waited at the fence; background = from the call's return to the end of the background writes and publish.
    ``on_record`` receives every record (the trackers log it).
    """

    def __init__(self, run_dir: Path, *, enabled: bool, on_record: Callable[[dict[str, Any]], None]) -> None:
        self.log = JsonlLog(Path(run_dir) / layout.EVENTS_LOG, enabled=enabled)
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
        """Append the ``checkpoint`` record of ``flight``; ``at_step``: the training step it is known at (an async
        save's record waits for the next save; trackers log it at that step, since their steps only increase)."""
        fence = float(getattr(flight.job, "fence_seconds", 0.0) or 0.0)
        blocked = flight.call_s + fence + extra_blocked
        self._blocked += blocked
        size = checkpoint_bytes(flight.path) if flight.path is not None and self.log.enabled else None
        writing = background_s if background_s is not None else blocked
        now = time.time()
        record = {
            "event": CHECKPOINT, "time": now, "step": flight.step, "at_step": at_step,
            "name": flight.path.name if flight.path is not None else None,
            "blocked_s": round(blocked, 4), "fence_s": round(fence, 4),
            "background_s": None if background_s is None else round(background_s, 4),
            "bytes": size, "write_gbps": round(size / writing / 1e9, 4) if size and writing > 0 else None,
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

    @property
    def share(self) -> float:
        return self.blocked_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def step_s(self) -> float | None:
        """Seconds per optimizer step, checkpoints left out."""
        return (self.wall_s - self.blocked_s) / self.steps if self.steps > 0 and self.wall_s > self.blocked_s else None


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    return read_jsonl(Path(run_dir) / layout.EVENTS_LOG)


def summarize(events: list[dict[str, Any]]) -> RunCosts:
    """The costs of the launches in ``events`` (``read_events``)."""
    launches: list[list[dict[str, Any]]] = []
    for record in events:
        if record.get("event") == START or not launches:
            launches.append([])
        launches[-1].append(record)
    wall = 0.0
    steps = 0
    interruptions = 0
    for i, launch in enumerate(launches):
        times = [float(r["time"]) for r in launch if isinstance(r.get("time"), (int, float))]
        if times:
            wall += max(times) - min(times)
        step_values = [int(r["step"]) for r in launch if isinstance(r.get("step"), int)]
        if step_values:
            steps += max(step_values) - step_values[0]
        ended = any(r.get("event") == END for r in launch)
        if not ended and i < len(launches) - 1:
            interruptions += 1
    saves = [r for r in events if r.get("event") == CHECKPOINT]
    blocked = [float(r["blocked_s"]) for r in saves if r.get("blocked_s") is not None]
    background = [float(r["background_s"]) for r in saves if r.get("background_s") is not None]
    sizes = [int(r["bytes"]) for r in saves if r.get("bytes")]
    rates = [float(r["write_gbps"]) for r in saves if r.get("write_gbps")]
    every = next((r.get("every_steps") for r in reversed(events) if r.get("event") == START and r.get("every_steps")),
                 None)
    if every is None:
        gaps = [b["step"] - a["step"] for a, b in zip(saves, saves[1:]) if b["step"] > a["step"]]
        every = int(statistics.median(gaps)) if gaps else None
    failures = [r for r in events if r.get("event") == SIDE_FAILURE and (r.get("kind") != "local_step" or _abandons(r))]
    return RunCosts(
        tracking_behind_s=sum(_behind_seconds(launch) for launch in launches), side_failures=len(failures),
        local_steps_abandoned=sum(1 for r in failures if r.get("kind") == "local_step"),
        launches=len(launches), interruptions=interruptions, wall_s=wall, steps=steps, checkpoints=len(saves),
        blocked_s=sum(blocked), blocked_per_checkpoint_s=statistics.fmean(blocked) if blocked else None,
        background_per_checkpoint_s=statistics.fmean(background) if background else None,
        bytes_per_checkpoint=statistics.fmean(sizes) if sizes else None,
        write_gbps=statistics.median(rates) if rates else None, every_steps=every,
    )


def _behind_seconds(launch: list[dict[str, Any]]) -> float:
    """Seconds of one launch during which at least one tracker was behind: from each ``tracking_behind`` to its
    backend's next ``tracking_caught_up``, or to the launch's last record."""
    times = [float(r["time"]) for r in launch if _is_time(r.get("time"))]
    if not times:
        return 0.0
    spans: list[tuple[float, float]] = []
    since: dict[str, float] = {}
    marks = [r for r in launch if r.get("event") in (BEHIND, CAUGHT_UP) and _is_time(r.get("time"))]
    for r in sorted(marks, key=lambda r: float(r["time"])):
        backend = str(r.get("backend"))
        if r["event"] == BEHIND:
            since.setdefault(backend, float(r["time"]))
        elif backend in since:
            spans.append((since.pop(backend), float(r["time"])))
    spans += [(t, max(times)) for t in since.values()]
    total, reach = 0.0, float("-inf")
    for a, b in sorted(spans):  # the union of the spans
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def _abandons(record: dict[str, Any]) -> bool:
    """Whether a ``local_step`` side failure is a step abandoned (its other lines: steps written again after
    failures, a folder made again)."""
    return " abandoned" in str(record.get("text", ""))


def _is_time(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
