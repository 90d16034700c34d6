"""torch's own async staging as a ``bench_async`` contender: ``DefaultStager`` under ``dcp.async_save``.

The ``torch_stager`` mode saves the same model and optimizer state as the ``async`` mode (this project's
overlapped snapshot, ``checkpoint.is_async: true``), through ``torch.distributed.checkpoint.async_save`` with one
``DefaultStager`` kept for the whole run, so that its host copies are allocated at the first save and reused after
(as this project's ``HostStager`` keeps its buffers):

* ``use_async_staging=True``: the copy runs on the stager's background thread; the save call returns at once;
* ``use_pinned_memory`` and ``use_non_blocking_copy``: on CUDA only (pinned host memory, copies on a stream of
  their own). On a CPU there is no device-to-host copy to pin for: torch ignores the first and refuses the second;
* ``use_shared_memory=False``: the writes run on a thread (``AsyncCheckpointerType.THREAD``), not a process.

The fence is the same as the checkpointer's: an optimizer step pre-hook that waits until the staged copy is
complete (``AsyncSaveResponse.staging_completion``), so forward and backward overlap the copy in both contenders.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

MODE = "torch_stager"
OURS = "async"


def staging_options(cuda: bool) -> Any:
    """The ``StagingOptions`` of the contender (see the module docstring)."""
    from torch.distributed.checkpoint.staging import StagingOptions

    return StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=True,
                          use_non_blocking_copy=cuda)


class TorchStagedSaves:
    """One run's saves through ``dcp.async_save`` with a kept ``DefaultStager``; ``fence_seconds`` accumulates the
    time the optimizer step waited for the staging of the save in flight."""

    def __init__(self, optimizer: torch.optim.Optimizer, process_group: Any) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager

        self.stager = DefaultStager(staging_options(torch.cuda.is_available() and torch.cuda.is_initialized()))
        self.group = process_group
        self.staged: Future | None = None
        self.durable: Future | None = None
        self.fence_seconds = 0.0
        self._hook = optimizer.register_step_pre_hook(lambda *_: self.fence())

    def fence(self) -> None:
        """Block until the save in flight has copied the live state."""
        if self.staged is None or self.staged.done():
            return
        t0 = time.perf_counter()
        self.staged.result()
        self.fence_seconds += time.perf_counter() - t0

    def save(self, state: dict, folder: Path) -> Future:
        """Start one save of ``state`` into ``folder`` (after the previous one is durable); its completion future."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        self.wait()
        self.fence_seconds = 0.0
        response = dcp.async_save(state, checkpoint_id=str(folder), process_group=self.group,
                                  async_checkpointer_type=AsyncCheckpointerType.THREAD, async_stager=self.stager)
        self.staged, self.durable = response.staging_completion, response.upload_completion
        return self.durable

    def wait(self) -> None:
        if self.durable is not None:
            self.durable.result()
            self.durable = None

    def close(self) -> None:
        self.wait()
        self._hook.remove()
        self.stager.close()


def _steady(saves: list[dict]) -> list[dict]:
    body = [s for s in saves if not s["final"]]
    return body[1:] or body


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _next_steps(run: dict, saves: list[dict]) -> list[float]:
    """How long the step after each of ``saves`` took (forward, backward, the fence wait and the optimizer step):
    what a background copy and write cost training beyond the save call, fence or slower step alike."""
    steps = run.get("steps", [])
    return [steps[s["step"]]["seconds"] for s in saves if s["step"] < len(steps)]


def _contender(runs: list[dict], none: list[dict]) -> dict:
    saves = [s for r in runs for s in _steady(r["saves"])]
    firsts = [(r, [s for s in r["saves"] if not s["final"]][:1]) for r in runs]
    rss, rss_none = _median([r["peak_rss_bytes"] for r in runs]), _median([r["peak_rss_bytes"] for r in none])
    return {
        "blocked": _median([s["stall"] for s in saves]),
        "call": _median([s["call"] for s in saves]),
        "fence": _median([s["fence"] for s in saves]),
        "copy": _median([s["capture"] for s in saves if s.get("capture") is not None]),
        "durable": _median([s["durable"] for s in saves if s.get("durable") is not None]),
        "next_step": _median([t for r in runs for t in _next_steps(r, _steady(r["saves"]))]),
        "first_next_step": _median([t for r, first in firsts for t in _next_steps(r, first)]),
        "busy_step": _median([x["seconds"] for r in runs for x in r.get("steps", [])[1:] if x["background"]]),
        "peak_rss": rss,
        "peak_rss_over_none": rss - rss_none if rss_none is not None else None,
    }


def compare(results: dict[str, list[dict]]) -> dict:
    """Ours (``async``) against torch's staging (``torch_stager``), medians over the steady-state saves of every
    repetition: training blocked (save call + fence), background copy, until durable, the step after a save, the
    steps while the background works, peak RSS over the ``none`` runs; and the ratios torch / ours. Empty when
    either contender did not run."""
    ok = {m: [r for r in runs if "failed" not in r] for m, runs in results.items()}
    if not ok.get(OURS) or not ok.get(MODE):
        return {}
    none = ok.get("none", [])
    out: dict = {mode: _contender(ok[mode], none) for mode in (OURS, MODE)}
    out["none_step"] = _median([x["seconds"] for r in none for x in r.get("steps", [])[1:]])
    ours, theirs = out[OURS], out[MODE]
    out["torch_over_ours"] = {key: theirs[key] / ours[key] if ours[key] and theirs[key] is not None else None
                              for key in ("blocked", "durable", "next_step", "peak_rss_over_none")}
    return out


def compare_table(cmp: dict, ratios: dict) -> str:
    """``compare`` as a markdown table; empty when it is."""
    if not cmp:
        return ""

    def mb(value: float | None) -> str:
        return "-" if value is None else f"{value / 2**20:+.0f}"

    def sec(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    def times(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    rows = ["| staging | training blocked (s) | of which: fence wait | background copy (s) | until durable (s) | "
            "step after a save (s) | after the first save | steps while writing (s) | peak RSS vs none (MiB) | "
            "tokens/s lost |", "|---|---|---|---|---|---|---|---|---|---|"]
    for mode, name in ((OURS, "ours (`async`)"), (MODE, "torch `DefaultStager` (`torch_stager`)")):
        c, lost = cmp[mode], ratios.get(f"run_overhead_{mode}")
        rows.append(f"| {name} | {sec(c['blocked'])} | {sec(c['fence'])} | {sec(c['copy'])} | {sec(c['durable'])} "
                    f"| {sec(c['next_step'])} | {sec(c['first_next_step'])} | {sec(c['busy_step'])} "
                    f"| {mb(c['peak_rss_over_none'])} | {'-' if lost is None else f'{100 * lost:+.1f}%'} |")
    ratio = cmp["torch_over_ours"]
    rows += ["", f"a step without checkpoints (median): {sec(cmp['none_step'])} s; torch / ours (median, steady "
                 f"state): training blocked {times(ratio['blocked'])}, until durable {times(ratio['durable'])}, "
                 f"step after a save {times(ratio['next_step'])}, peak RSS added {times(ratio['peak_rss_over_none'])}"]
    return "\n".join(rows)
