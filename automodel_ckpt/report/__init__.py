"""``ckpt-train report``: one self-contained HTML page of a run folder (curves, checkpoints, data, cost, lineage).

The run folder is read through bounded readers (``runinfo``, ``logs``) and every string from it escaped (``html.el``);
``LiveReport`` rewrites ``RUN_DIR/report.html`` off the training thread (``logging.report``). docs/report.md.
"""

from __future__ import annotations

import threading
import warnings
from pathlib import Path
from typing import Any

from automodel_ckpt.errors import UserError, first_line
from automodel_ckpt.ondisk import CheckpointFolder, RunFolder, is_count, write_atomic
from automodel_ckpt.report import checkpoints as tables
from automodel_ckpt.report import curves
from automodel_ckpt.report.html import page
from automodel_ckpt.report.logs import run_logs
from automodel_ckpt.report.runinfo import inspect_dir

PANELS = (("curves", "Curves", curves.curves), ("eval", "Eval scores", curves.evals),
          ("checkpoints", "Checkpoints", tables.checkpoints), ("data", "Data", tables.data),
          ("cost", "Cost", tables.cost), ("algorithm", "Algorithm", curves.algorithm),
          ("lineage", "Lineage", tables.lineage))


def collect(run_dir: Path) -> dict[str, Any]:
    """What the panels show of ``run_dir``, read within bounds."""
    from automodel_ckpt.training.stages import read_history

    run_dir = Path(run_dir).expanduser()
    if not run_dir.is_dir():
        raise UserError(f"run folder '{run_dir}' not found")
    if CheckpointFolder(run_dir).metadata.is_file():  # a checkpoint named: its run folder
        run_dir = run_dir.resolve().parent
    listing = inspect_dir(run_dir)
    logs = run_logs(run_dir)
    present = {r["step"] for r in listing["checkpoints"]} | {q["step"] for q in listing["quarantined"]
                                                            if is_count(q["step"])}
    staged = [r for r in listing["checkpoints"] if isinstance((r.get("metadata") or {}).get("stages"), list)]
    stages, problem = [], None
    if staged:
        try:
            stages = read_history(staged[-1]["metadata"], f"{staged[-1]['name']}/{CheckpointFolder.metadata}")[0]
        except UserError as exc:
            problem = f"stages not readable: {first_line(exc)}"
    return {"dir": run_dir, "checkpoints": listing, "logs": logs, "stages": stages, "stages_problem": problem,
            "deleted": sorted(s for s in logs["events"].saves if s not in present)}


def render(run_dir: Path) -> str:
    run = collect(run_dir)
    return page(f"ckpt-train report: {run['dir'].resolve().name}", [(a, h, panel(run)) for a, h, panel in PANELS])


def write(run_dir: Path, out: Path | None = None) -> Path:
    """Write the page (default ``run_dir/report.html``) and return its path."""
    text = render(run_dir)
    out = Path(out) if out is not None else RunFolder(run_dir).report
    write_atomic(out, text.encode("utf-8"))  # a link or FIFO at ``out`` is replaced, never written through
    return out


class LiveReport:
    """``logging.report``: ``RUN_DIR/report.html`` rewritten by a daemon thread each time ``request`` is called (at
    each checkpoint); a failure is one warning, and training goes on."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir, self.path = Path(run_dir), RunFolder(run_dir).report
        self._due, self._stop = threading.Event(), False
        self._thread = threading.Thread(target=self._loop, name="ckpt-report", daemon=True)
        self._thread.start()

    def request(self, *_: Any) -> None:
        self._due.set()

    def close(self, timeout: float = 30.0) -> None:
        """One last page (the run's end), waited for at most ``timeout`` seconds."""
        self._stop = True
        self._due.set()
        self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            self._due.wait()
            self._due.clear()
            try:
                write(self.run_dir, self.path)
            except Exception as exc:  # noqa: BLE001 - the page is side work: one warning, never the run's end
                warnings.warn(f"logging.report: {self.path} not written ({type(exc).__name__}: {first_line(exc)})",
                              stacklevel=1)
            if self._stop:
                return
