"""What a recipe reports about one launch, in one object: metrics and events to the trackers, checkpoint costs."""

from __future__ import annotations

import itertools
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import yaml

from automodel_ckpt.ondisk import quarantined_checkpoints
from automodel_ckpt.errors import first_line
from automodel_ckpt.tracking.costlog import SIDE_FAILURE, CheckpointCosts, iter_events, summarize
from automodel_ckpt.tracking.costreport import cost_report, one_line
from automodel_ckpt.tracking.tracker import RunTracker, checkpoint_metrics, train_metrics, validation_metrics


class RunObserver:
    """The trackers of ``logging:`` and the cost log, rank 0; they log ``config_yaml``'s hyper-parameters."""

    on_checkpoint: Callable[[dict[str, Any]], None] | None = None  # called with each save's record (logging.report)

    def __init__(self, section: Any, run_dir: Path, *, is_main: bool, config_yaml: str) -> None:
        self.run_dir = Path(run_dir)
        self.is_main = is_main
        self.costs = CheckpointCosts(self.run_dir, enabled=is_main, on_record=self._checkpoint_record)
        self.tracker = RunTracker(section, self.run_dir, enabled=is_main,
                                  hparams=lambda: yaml.safe_load(config_yaml) or {}, record=self.costs.note)
        self.side_failures: dict[str, int] = {}  # kind -> how many this launch (``side_failure``)
        self._launched = time.time()
        self._step = 0

    def start(self, step: int, restored: Path | None, **facts: Any) -> None:
        """A launch begins at ``step`` (``restored``: the checkpoint it resumed from): record it, open the trackers."""
        self._step = step
        events: list[tuple[str, str]] = []
        if self.is_main:
            for q in quarantined_checkpoints(self.run_dir):  # moved aside by this launch's restore
                if (q.get("quarantined_at") or 0) >= self._launched:
                    events.append(("fallback", f"checkpoint {q['name']} could not be loaded ({q['reason']}); moved "
                                               "to quarantine/ and resumed from the newest checkpoint before it"))
            if restored is not None:
                tier = f" (the {facts['tier']} tier, loaded in {facts['load_seconds']} s)" if facts.get("tier") else ""
                events.append(("resume", f"resumed from {restored.name} at step {step}{tier}"))
        self.costs.start(step, restored.name if restored is not None else None,
                         fallbacks=[text for kind, text in events if kind == "fallback"], **facts)
        self.tracker.start(step, resumed=restored is not None, events=events)

    def log_train(self, record: dict[str, Any]) -> None:
        self._step = int(record["step"])
        self.tracker.log(train_metrics(record), self._step)

    def log_validation(self, record: dict[str, Any]) -> None:
        self.tracker.log(validation_metrics(record), int(record["step"]))

    def save(self, save: Callable[[], Path | None], step: int, background: Callable[[], Any], *,
             preemption: bool = False) -> Path | None:
        """Run the recipe's save, timed (``CheckpointCosts``), after an untimed catch-up of the trackers."""
        self.tracker.flush()
        path = self.costs.save(save, step, background, preemption=preemption)
        if preemption:
            self.tracker.event("preemption", f"preempted at step {step}: saved {path}", step)
        return path

    def finalize(self, finalize: Callable[[], Any], step: int) -> Any:
        return self.costs.finalize(finalize, step)

    def observed_mtbf_s(self) -> float | None:
        """The MTBF the run's cost log shows (wall time over interruptions), None without any (rank 0)."""
        costs = summarize(iter_events(self.run_dir)) if self.is_main else None
        return costs.wall_s / costs.interruptions if costs is not None and costs.interruptions else None

    def interval(self, record: dict[str, Any]) -> None:
        """The ``auto`` save interval changed: an ``interval`` record and an event to the trackers."""
        self.costs.note(record)
        self.tracker.event("interval", record["text"], int(record["step"]))

    def side_failure(self, kind: str, text: str, step: int) -> None:
        """Side work failed, training goes on: recorded, told to the trackers, counted (any rank or thread may call)."""
        self.side_failures[kind] = self.side_failures.get(kind, 0) + 1
        self.costs.note({"event": SIDE_FAILURE, "time": time.time(), "kind": kind, "text": text, "at_step": step})
        self.tracker.event(f"side_failure.{kind}", text, step)

    def end(self, step: int, status: str) -> str:
        """The launch ends: close the trackers, then record it; the cost line."""
        end = self.costs.end_record(step, status)
        line = ""
        if self.is_main:
            try:
                line = one_line(cost_report(summarize(itertools.chain(iter_events(self.run_dir), [end]))))
            except Exception as exc:  # noqa: BLE001 - a report is side work: one warning, never the end of a run
                text = f"the cost report failed ({type(exc).__name__}: {first_line(exc)})"
                warnings.warn(text, stacklevel=2)
                self.side_failure("cost_report", text, step)
        self.tracker.event("end", f"{status} at step {step}. {line}", step)
        self.tracker.close(status)
        self.costs.note(end)
        return line

    def fail(self) -> None:
        """The launch fails: close the trackers (no ``end`` record: a later resume counts it as an interruption)."""
        self.tracker.close("failed")

    def _checkpoint_record(self, record: dict[str, Any]) -> None:
        self.tracker.log(checkpoint_metrics(record), int(record.get("at_step", record["step"])))
        if self.on_checkpoint is not None:
            self.on_checkpoint(record)
