"""``ckpt-train inspect CHECKPOINT_DIR [--json] [--cost [--mtbf-hours H]] [--lineage]``: checkpoints, cost, lineage."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from automodel_ckpt.ondisk import CheckpointFolder, RunFolder, pointer_target
from automodel_ckpt.checkpoint import MTBF_LIMIT_HOURS, is_url, open_for_reading
from automodel_ckpt.cli.common import VerbParser, human_size
from automodel_ckpt.errors import UsageError, UserError
from automodel_ckpt.report.runinfo import data_position_line, inspect_dir, stages_lines
from automodel_ckpt.shown import one_line
from automodel_ckpt.tracking import cost_report, iter_events, render_cost, summarize

_COLUMNS = ("NAME", "STEP", "EPOCH", "VAL_LOSS", "SIZE", "FAMILY", "FORMAT", "MESH", "CONSOLIDATED", "COMPLETE", "POINTERS")


def build_parser() -> VerbParser:
    p = VerbParser("inspect", "List the checkpoints of a run folder.")
    p.add_argument("checkpoint_dir", help="the run's checkpoint.checkpoint_dir (or one checkpoint in it); a path or "
                                          "an object store URL (s3://BUCKET/RUN); or an archive (ckpt-train pack)")
    p.add_argument("--json", action="store_true", help="print the listing as JSON")
    p.add_argument("--cost", action="store_true", help="what checkpoints cost this run, and the Young/Daly interval "
                                                        "for its failure rate (docs/tracking.md)")
    p.add_argument("--lineage", action="store_true",
                   help="where CHECKPOINT_DIR (a checkpoint, a run folder's LATEST, an export folder or file) "
                        "came from: its parents back to the base model, with their fingerprints "
                        "(docs/inspect-and-diff.md)")
    p.add_argument("--mtbf-hours", type=float, default=None,
                   help="mean time between failures for --cost (default: observed in the run, else 24)")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.mtbf_hours is not None and (not 0 < args.mtbf_hours <= MTBF_LIMIT_HOURS or not args.cost):
        raise UsageError(f"--mtbf-hours: needs --cost and a number of hours above 0, at most {MTBF_LIMIT_HOURS:g}")
    from automodel_ckpt.export import describe_archive, identify, is_archive, lineage_chain

    if args.lineage:
        if args.cost or args.json:
            raise UsageError("--lineage: give it alone (not with --cost or --json)")
        target = Path(args.checkpoint_dir)
        latest = pointer_target(target, RunFolder.latest) if target.is_dir() and not target.is_symlink() \
            and not CheckpointFolder(target).metadata.exists() else None
        said = [] if latest is None else [  # a run folder: the chain of the checkpoint its LATEST names
            one_line(f"'{target}' is a run folder: the lineage of its {RunFolder.latest}, {latest.name}")]
        text = "\n".join([*said, *lineage_chain(latest or target)])
    else:
        local = open_for_reading(args.checkpoint_dir, key="inspect")  # a URL's archive: downloaded once
        target = identify(local)  # one file an export target wrote, as the registry recognises it
        if target is not None or is_archive(local):  # one file: its header, nothing of a run
            what, read, render = (target.noun, target.describe, target.render) if target is not None else \
                ("an archive", describe_archive, render_archive)
            if args.cost:
                raise UsageError(f"--cost: needs a run folder, not {what}")
            info = read(local)
            print(json.dumps(info, indent=2) if args.json else render(info), flush=True)
            return 0
        report = cost_of(local, args.mtbf_hours) if args.cost else inspect_dir(local)
        if is_url(args.checkpoint_dir):  # listed through a local mirror; show where it really is
            report["checkpoint_dir"] = args.checkpoint_dir
        text = json.dumps(report, indent=2) if args.json else render_cost(report) if args.cost else render_table(report)
    try:
        print(text, flush=True)
    except BrokenPipeError:  # e.g. `| head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def render_archive(info: dict[str, Any]) -> str:
    """What an archive holds (``archive.describe_archive``) in a few lines."""
    came = (f" from checkpoint {info['checkpoint']} of run {info['run']} (step {info['step']}, epoch "
            f"{info['epoch']})" if info["checkpoint"] else f" from an {info['source']} folder")
    from automodel_ckpt.export import export_targets

    held = next((t for t in export_targets() if t.noun and t.name == info["source"]), None)
    if held is not None:  # one file an export target wrote: `inspect` it unpacked for its model
        return "\n".join([f"archive {info['archive']}: {held.noun} (inspect it after `tar -xf` for its model)",
                          f"  {info['files']} members, {human_size(info['bytes'])}"])
    model = f"{info['model_type'] or 'unknown family'}" + (f" ({info['architecture']})" if info["architecture"] else "")
    dtypes = ", ".join(f"{k} {v:,}" for k, v in info["dtypes"].items()) or "no weights"
    return "\n".join([f"archive {info['archive']}: {info['holds']}{came}",
                      f"  model: {model}, {info['parameters']:,} parameters ({dtypes})",
                      f"  {info['files']} members, {human_size(info['bytes'])}"])


def cost_of(path: Path, mtbf_hours: float | None) -> dict[str, Any]:
    """``--cost``: the cost report of the run folder ``path`` (or of the run of the checkpoint it names)."""
    path = Path(path).expanduser()
    if CheckpointFolder(path).metadata.is_file():
        path = path.resolve().parent
    costs = summarize(iter_events(path))  # streamed: a log of any size is read in bounded memory
    if not costs.launches:
        raise UserError(f"'{path}' has no {RunFolder.events_log} (or no record in it): the cost report needs a run "
                        "folder trained with checkpoint costs recorded (this version or later)")
    return {"checkpoint_dir": str(path), **cost_report(costs, mtbf_hours)}


def render_table(report: dict[str, Any]) -> str:
    lines = [[*_COLUMNS]]
    for r in report["checkpoints"]:
        val = f"{r['val_loss']:.4f}" if isinstance(r["val_loss"], float) else _text(r["val_loss"])
        lines.append([r["name"], _text(r["step"]), _text(r["epoch"]), val, human_size(r["size_bytes"]),
                      _text(r.get("family")), _text(r["format"]), _text(r.get("mesh")),
                      "yes" if r["consolidated"] else "no", "yes" if r["complete"] else "no",
                      ", ".join(r["pointers"]) or "-"])
    if any(r.get("shared_bytes") for r in report["checkpoints"]):  # checkpoint.incremental: own / shared bytes
        lines[0].append("OWN / SHARED")
        for line, r in zip(lines[1:], report["checkpoints"]):
            line.append(f"{human_size(r['own_bytes'])} / {human_size(r['shared_bytes'])}"
                        if r.get("shared_bytes") is not None else "-")
    if any(r.get("eval") for r in report["checkpoints"]):  # a column once some checkpoint was evaluated
        lines[0].append("EVAL")
        for line, r in zip(lines[1:], report["checkpoints"]):
            line.append(", ".join(f"{k} {v:.4f}" for k, v in (r.get("eval") or {}).items()) or "-")
    widths = [max(len(row[i]) for row in lines) for i in range(len(lines[0]))]
    numeric = {1, 2, 3, 4}
    out = ["  ".join(cell.rjust(w) if i in numeric else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths)))
           .rstrip() for row in lines]
    counted = [r for r in report["checkpoints"] if r.get("counters")]
    if counted:
        out.append("counters:")
        out += [f"  {r['name']}: " + ", ".join(f"{k} {_text(v)}" for k, v in r["counters"].items()) for r in counted]
    totals = report["totals"]
    out.append(
        f"{totals['count']} checkpoint{'s' if totals['count'] != 1 else ''} "
        f"({totals['complete']} complete), {human_size(totals['size_bytes'])} in total"
        + ((f", {human_size(totals['stored_bytes'])} stored (shared pieces stored once)"
            if is_url(report["checkpoint_dir"]) else
            f", {human_size(totals['stored_bytes'])} on disk (files shared by hard link stored once)")
           if totals.get("stored_bytes") is not None and totals["stored_bytes"] < totals["size_bytes"] else "")
    )
    positioned = [r for r in report["checkpoints"] if r.get("data_position")]
    if positioned:
        out.append(data_position_line(positioned[-1]["name"], positioned[-1]["data_position"]))
    staged = [r for r in report["checkpoints"] if (r.get("metadata") or {}).get("stages") is not None]
    if staged:  # a run in stages (docs/stages.md): those its newest checkpoint lists
        out += stages_lines(staged[-1]["name"], staged[-1]["metadata"])
    quarantined = report.get("quarantined") or []
    if quarantined:
        out.append(f"quarantined (failed to load on resume; kept in {RunFolder.quarantine}/, never resumed from):")
        for q in quarantined:
            out.append(f"  {q['name']}  step {_text(q['step'])}: {q['reason'] or 'reason not recorded'}")
    for name, pointer in report["pointers"].items():
        if pointer["target"] is None:
            if name != RunFolder.best_eval:  # set only where a score is monitored: unset says nothing
                out.append(f"{name}: not set")
        elif not pointer["exists"]:
            out.append(f"{name} -> {pointer['target']} (missing)")
    return "\n".join(out)


def _text(value: Any) -> str:
    return "-" if value is None else str(value)
