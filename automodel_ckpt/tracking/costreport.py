"""The cost report of a run: what its checkpoints cost, and the Young/Daly interval for its failure rate."""

from __future__ import annotations

import contextlib
from dataclasses import asdict
from typing import Any

from automodel_ckpt.checkpoint import DEFAULT_MTBF_HOURS
from automodel_ckpt.sizes import human_size
from automodel_ckpt.tracking.costlog import RunCosts
from automodel_ckpt.tracking.interval import advise, expected_overhead


def cost_report(costs: RunCosts, mtbf_hours: float | None = None) -> dict[str, Any]:
    """JSON-ready numbers: the costs, the MTBF and its source (given, the run's, its interruptions, else 24 h), the
    advice, and for ``auto`` its overhead beside the fixed interval it replaced."""
    if mtbf_hours is not None:
        mtbf_s, source = mtbf_hours * 3600.0, "given"
    elif costs.mtbf_hours is not None:
        mtbf_s, source = costs.mtbf_hours * 3600.0, "configured"
    elif costs.interruptions:
        mtbf_s, source = costs.wall_s / costs.interruptions, "observed"
    else:
        mtbf_s, source = DEFAULT_MTBF_HOURS * 3600.0, "assumed"
    report: dict[str, Any] = {
        "launches": costs.launches, "interruptions": costs.interruptions, "wall_s": costs.wall_s,
        "steps": costs.steps, "step_s": costs.step_s, "checkpoints": costs.checkpoints,
        "blocked_s": round(costs.blocked_s, 4), "blocked_per_checkpoint_s": costs.blocked_per_checkpoint_s,
        "background_per_checkpoint_s": costs.background_per_checkpoint_s,
        "bytes_per_checkpoint": costs.bytes_per_checkpoint, "written_per_checkpoint": costs.written_per_checkpoint,
        "write_gbps": costs.write_gbps,
        "share_of_wall": costs.share, "every_steps": costs.every_steps,
        "mtbf_s": mtbf_s, "mtbf_source": source, "advice": None,
        "tracking_behind_s": round(costs.tracking_behind_s, 3), "side_failures": costs.side_failures,
        "local_steps_abandoned": costs.local_steps_abandoned,
    }
    cost, step_s = costs.blocked_per_checkpoint_s, costs.step_s
    if cost is not None and step_s:
        with contextlib.suppress(ValueError):  # a log's numbers out of range (an infinite mean, an MTBF of 1e308 h)
            report["advice"] = asdict(advise(cost, mtbf_s, step_s, latency_s=costs.background_per_checkpoint_s or 0.0,
                                             current_every_steps=costs.every_steps))
    if costs.auto_changes is not None:  # ckpt_every_steps: auto, beside the fixed interval it replaced
        fixed, paid = costs.replaced_every_steps, costs.every_steps
        timed = cost is not None and bool(step_s)
        latency = costs.background_per_checkpoint_s or 0.0
        report["auto"] = {"changes": costs.auto_changes, "every_steps": costs.auto_every_steps,
                          "overhead": expected_overhead(paid * step_s, cost, mtbf_s, latency)
                          if paid and timed else None,  # at the spacing its saves came at
                          "replaced_every_steps": fixed, "replaced_overhead": expected_overhead(
                              fixed * step_s, cost, mtbf_s, latency) if fixed and timed else None}
    return report


def _duration(seconds: float) -> str:
    if seconds >= 5400:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 90:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.2f} s"


TRAINING_FLAG = "--checkpoint.mtbf_hours"  # a training run's override, named by the line at its end
INSPECT_FLAG = "--mtbf-hours"  # ``ckpt-train inspect --cost``'s


def _mtbf(report: dict[str, Any], flag: str) -> str:
    """``MTBF 24.0 h (where it comes from)``; an assumed one names ``flag``, the option that sets it."""
    source = report["mtbf_source"]
    why = {"given": "given", "configured": "the run's checkpoint.mtbf_hours", "observed": f"observed: {report['interruptions']} interruption(s)",
           "assumed": f"assumed, no interruption seen; set it with {flag}"}[source]
    return f"MTBF {_duration(report['mtbf_s'])} ({why})"


def one_line(report: dict[str, Any], flag: str = TRAINING_FLAG) -> str:
    """The line printed at the end of a run ("" without checkpoints); ``flag``: the option that sets the MTBF."""
    if not report["checkpoints"]:
        return ""
    text = (f"Checkpoint cost: {report['checkpoints']} checkpoint(s), {report['blocked_per_checkpoint_s']:.3f} s "
            f"blocking each")
    if report["background_per_checkpoint_s"] is not None:
        text += f" + {report['background_per_checkpoint_s']:.2f} s in the background"
    text += f", {100 * report['share_of_wall']:.2f}% of run time"
    text += _written(report, "; ")
    advice = report["advice"]
    if advice is not None:
        text += (f"; Young/Daly interval for {_mtbf(report, flag)}: every {advice['interval_steps']} steps "
                 f"({_duration(advice['interval_s'])}), expected overhead {100 * advice['overhead']:.2f}%")
    text += _auto(report)
    return text + _side_work(report)


def _auto(report: dict[str, Any]) -> str:
    """The end line's ``auto`` note: its expected overhead beside the fixed interval it replaced ("" without both)."""
    auto = report.get("auto")
    if not auto or auto["overhead"] is None or auto["replaced_overhead"] is None:
        return ""
    return (f"; ckpt_every_steps auto: saves every {report['every_steps']} steps, expected overhead "
            f"{100 * auto['overhead']:.2f}% against {100 * auto['replaced_overhead']:.2f}% at the fixed every "
            f"{auto['replaced_every_steps']} steps it replaced")


def _written(report: dict[str, Any], lead: str) -> str:
    """``; wrote 1.2 MiB per checkpoint, 14.3% of a full save`` where saves linked unchanged files, else ""."""
    size, written = report.get("bytes_per_checkpoint"), report.get("written_per_checkpoint")
    if not size or written is None or written >= size:
        return ""
    return f"{lead}wrote {human_size(int(written))} per checkpoint, {100 * written / size:.1f}% of a full save"


def _side_work(report: dict[str, Any]) -> str:
    """The end line's note on side work: ``; tracking behind 12.3 s; 2 local step(s) abandoned`` ("" if none)."""
    parts = []
    if report.get("tracking_behind_s"):
        parts.append(f"tracking behind {_duration(report['tracking_behind_s'])}")
    if report.get("local_steps_abandoned"):
        parts.append(f"{report['local_steps_abandoned']} local step(s) abandoned")
    others = (report.get("side_failures") or 0) - (report.get("local_steps_abandoned") or 0)
    if others:
        parts.append(f"{others} side failure(s) (see events.jsonl)")
    return "".join(f"; {p}" for p in parts)


def render(report: dict[str, Any]) -> str:
    """``ckpt-train inspect RUN --cost``: the measured costs, then the interval advice."""
    size = report["bytes_per_checkpoint"]
    rate = report["write_gbps"]
    lines = [
        f"launches:                   {report['launches']} ({report['interruptions']} interrupted)",
        f"wall time:                  {_duration(report['wall_s'])} over {report['steps']} steps"
        + (f" ({report['step_s']:.3f} s/step without checkpoints)" if report["step_s"] else ""),
        f"checkpoints:                {report['checkpoints']}"
        + (f", every {report['every_steps']} steps" if report["every_steps"] else ""),
    ]
    if report["checkpoints"]:
        lines += [
            f"blocking per checkpoint:    {report['blocked_per_checkpoint_s']:.3f} s (training thread waited)",
            f"background per checkpoint:  {report['background_per_checkpoint_s']:.3f} s"
            if report["background_per_checkpoint_s"] is not None else "background per checkpoint:  - (synchronous)",
            f"size per checkpoint:        {human_size(size)}"
            + (f", written at {human_size(int(rate * 1e9))}/s" if rate else "")
            if size else "size per checkpoint:        -",
            *([f"written per checkpoint:     {human_size(int(report['written_per_checkpoint']))} = "
               f"{100 * report['written_per_checkpoint'] / size:.1f}% of a full save (the rest hard-linked: "
               "checkpoint.incremental)"] if _written(report, "") else []),
            f"run time lost:              {report['blocked_s']:.2f} s = {100 * report['share_of_wall']:.2f}% of wall time",
        ]
    lines += [
        f"tracking behind:            {_duration(report.get('tracking_behind_s') or 0.0)}"
        " (a tracker not waited for, until it caught up)",
        f"local steps abandoned:      {report.get('local_steps_abandoned') or 0}",
        f"side failures:              {report.get('side_failures') or 0} (exports, local steps, reports; "
        "training went on)",
    ]
    advice = report["advice"]
    if advice is None:
        lines.append("interval advice:            needs at least one checkpoint and one timed step")
        return "\n".join(lines)
    lines += [
        f"failure rate:               {_mtbf(report, INSPECT_FLAG)}",
        f"Young/Daly interval:        sqrt(2 x {report['blocked_per_checkpoint_s']:.3f} s x {report['mtbf_s']:.0f} s) = "
        f"{_duration(advice['interval_s'])} = every {advice['interval_steps']} steps, expected overhead "
        f"{100 * advice['overhead']:.2f}%",
    ]
    if advice["current_overhead"] is not None:
        lines.append(f"at the run's own interval:  every {report['every_steps']} steps "
                     f"({_duration(advice['current_interval_s'])}), expected overhead "
                     f"{100 * advice['current_overhead']:.2f}%")
    auto = report.get("auto")
    if auto is not None:
        lines.append(f"ckpt_every_steps auto:      {auto['changes']} change(s), last every "
                     f"{auto['every_steps'] or '-'} steps; the run's saves came every {report['every_steps']} steps"
                     + (f", expected overhead {100 * auto['overhead']:.2f}%" if auto["overhead"] is not None else ""))
        if auto["replaced_overhead"] is not None:
            lines.append(f"at the interval it replaced: every {auto['replaced_every_steps']} steps, expected "
                         f"overhead {100 * auto['replaced_overhead']:.2f}%")
    return "\n".join(lines)
