"""``ckpt-train inspect CHECKPOINT_DIR [--json] [--cost [--mtbf-hours H]] [--lineage]``: checkpoints, cost, lineage."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from automodel_ckpt.ondisk import (CONFIG_FILE_LIMIT, INDEX_FILE_LIMIT, LAYOUT, SMALL_FILE_LIMIT, CheckpointRecord,
                                   as_float, pointer_target, pointer_targets,
                                   quarantined_checkpoints, read_json, scan_checkpoints, shared_bytes, size_on_disk,
                                   stored_once)
from automodel_ckpt.distributed.mesh import MeshSizes
from automodel_ckpt.checkpoint import is_url, open_for_reading, source_of, stored_files, stored_sharing
from automodel_ckpt.cli.common import VerbParser, human_size
from automodel_ckpt.errors import UsageError, UserError
from automodel_ckpt.jsonsafe import json_safe
from automodel_ckpt.shown import one_line
from automodel_ckpt.tracking import cost_report, iter_events, render_cost, summarize
from automodel_ckpt.checkpoint import MTBF_LIMIT_HOURS

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
        latest = pointer_target(target, LAYOUT.LATEST) if target.is_dir() and not target.is_symlink() \
            and not (target / LAYOUT.METADATA_FILE).exists() else None
        try:
            if latest is not None:  # a run folder: the chain of the checkpoint its LATEST names
                said = f"'{target}' is a run folder: the lineage of its {LAYOUT.LATEST}, {latest.name}"
                print(one_line(said), flush=True)
                target = latest
            print("\n".join(lineage_chain(target)), flush=True)
        except BrokenPipeError:  # e.g. `| head`: the reader has what it wanted
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
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
    try:
        text = render_cost(report) if args.cost else render_table(report)
        print(json.dumps(report, indent=2) if args.json else text, flush=True)
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
    if (path / LAYOUT.METADATA_FILE).is_file():
        path = path.resolve().parent
    costs = summarize(iter_events(path))  # streamed: a log of any size is read in bounded memory
    if not costs.launches:
        raise UserError(f"'{path}' has no {LAYOUT.EVENTS_LOG} (or no record in it): the cost report needs a run "
                        "folder trained with checkpoint costs recorded (this version or later)")
    return {"checkpoint_dir": str(path), **cost_report(costs, mtbf_hours)}


def inspect_dir(path: Path) -> dict[str, Any]:
    """The listing of a checkpoint_dir (or of the one checkpoint ``path`` names) as plain JSON-ready values."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise UserError(f"checkpoint folder '{path}' not found")
    only = None
    if (path / LAYOUT.METADATA_FILE).is_file():  # a checkpoint itself: show its row in its run folder
        path, only = path.resolve().parent, path.resolve().name
    pointers = pointer_targets(path)
    records = scan_checkpoints(path, include_incomplete=True)
    # an object store's mirror: files shared as the run's pieces (checkpoint.incremental), over all its checkpoints
    pieces = stored_sharing(path, [r.name for r in records]) if records and source_of(records[0].path) else None
    rows = [_row(r, pointers, pieces[0] if pieces else None) for r in records if only is None or r.name == only]
    totals = {"count": len(rows), "complete": sum(r["complete"] for r in rows),
              "size_bytes": sum(r["size_bytes"] for r in rows)}
    if pieces is not None and only is None:  # each piece stored once
        totals["stored_bytes"] = pieces[1]
    elif any(r.get("shared_bytes") for r in rows) and pieces is None:  # files shared by hard link counted once
        totals["stored_bytes"] = stored_once([path / r["name"] for r in rows if r.get("shared_bytes") is not None])
    return {
        "checkpoint_dir": str(path),
        "pointers": {p: {"target": t, "exists": pointer_target(path, p) is not None}
                     for p, t in pointers.items()},
        "checkpoints": rows,
        "quarantined": quarantined_checkpoints(path) if only is None else [],
        "totals": totals,
    }


def _row(record: CheckpointRecord, pointers: dict[str, str | None],
         pieces: dict[str, tuple[int, int]] | None = None) -> dict[str, Any]:
    meta = record.metadata or {}
    stored = stored_files(record.path) if source_of(record.path) else None  # a mirror: the store's files
    own_shared = (shared_bytes(record.path) if stored is None
                  else pieces.get(record.name, (None, None)) if pieces is not None else (None, None))
    return {
        "name": record.name,
        "step": record.step,
        "epoch": record.epoch,
        "consumed_samples": meta.get("consumed_samples"),
        "counters": (meta.get("extra") or {}).get("counters"),  # an algorithm's own (a preference run's dpo_step)
        "train_loss": json_safe(as_float(meta.get("train_loss"))),
        "val_loss": json_safe(as_float(meta.get("val_loss"))),
        "size_bytes": sum(stored.values()) if stored is not None else size_on_disk(record.path),
        # own: bytes only this checkpoint holds; shared: files it shares with another checkpoint by hard link (on
        # an object store: as a piece another checkpoint references too)
        **dict(zip(("own_bytes", "shared_bytes"), own_shared)),
        "family": model_family(record.path),
        "format": meta.get("model_save_format") or _detected_format(record.path),
        "mesh": _mesh(meta),
        "consolidated": LAYOUT.consolidated_dir(record.path).is_dir() if stored is None else
        any(rel.startswith(f"{LAYOUT.MODEL_DIR}/{LAYOUT.CONSOLIDATED_DIR}/") for rel in stored),
        "complete": record.complete,
        "pointers": [p for p, target in pointers.items() if target == record.name],
        "data_position": (meta.get("extra") or {}).get("data_position"),
        "eval": eval_scores(record.path),
        "metadata": record.metadata,
    }


def eval_scores(ckpt: Path) -> dict[str, float] | None:
    """``ckpt-train eval``'s scores kept in the checkpoint: ``{"task/metric": value}``, the first metric of each
    task (None when it was never evaluated; a results file that cannot be read is left out)."""
    folder = Path(ckpt) / LAYOUT.EVAL_DIR
    if folder.is_symlink() or not folder.is_dir():
        return None
    scores: dict[str, float] = {}
    for path in sorted(folder.glob(f"*{LAYOUT.EVAL_SUFFIX}")):
        try:
            results = read_json(path, "eval results", INDEX_FILE_LIMIT).get("results") or {}
            for task, values in results.items():
                metric = next(k for k, v in values.items() if "," in k and "_stderr" not in k
                              and isinstance(v, (int, float)) and not isinstance(v, bool))
                scores[f"{task}/{metric.split(',')[0]}"] = float(values[metric])
        except (OSError, AttributeError, StopIteration, TypeError, UserError):
            continue
    return scores or None


def _detected_format(checkpoint: Path) -> str | None:
    """The model format of a checkpoint whose metadata does not name it (an early release's), from its files. Only
    then are the format modules (and torch with them) imported: reading a run folder needs neither."""
    from automodel_ckpt.ondisk import detect_model_format

    return detect_model_format(LAYOUT.model_dir(checkpoint))


def _mesh(meta: dict[str, Any]) -> str | None:
    """The mesh that wrote the checkpoint, as the resume line says it: ``dp 4``, ``dp 2 × tp 2``, ``HSDP 2 × 2``."""
    if not meta.get("world_size"):
        return None
    try:
        return MeshSizes.from_record(meta.get("mesh"), int(meta["world_size"])).describe()
    except (TypeError, ValueError):
        return None


def model_family(ckpt: Path) -> str | None:
    """The model's ``model_type`` (llama, mixtral, ...), from the saved HF config or the adapter's base."""
    model = LAYOUT.model_dir(ckpt)
    candidates = [(LAYOUT.hf_metadata_dir(model) / LAYOUT.HF_CONFIG, False)]
    with contextlib.suppress(OSError, TypeError, AttributeError, UserError):
        adapter = read_json(model / LAYOUT.ADAPTER_CONFIG, "an adapter config", SMALL_FILE_LIMIT)
        if adapter.get("base_model_name_or_path"):  # a base folder, maybe a Hugging Face cache snapshot of links
            candidates.append((Path(adapter["base_model_name_or_path"]) / LAYOUT.HF_CONFIG, True))
    for path, follow in candidates:
        try:
            value = read_json(path, "a model config", CONFIG_FILE_LIMIT, follow=follow).get("model_type")
        except (OSError, AttributeError, UserError):
            continue
        if value:
            return str(value)
    return None


def render_table(report: dict[str, Any]) -> str:
    lines = [[*_COLUMNS]]
    for r in report["checkpoints"]:
        lines.append([
            r["name"],
            _text(r["step"]),
            _text(r["epoch"]),
            f"{r['val_loss']:.4f}" if isinstance(r["val_loss"], float) else _text(r["val_loss"]),
            human_size(r["size_bytes"]),
            _text(r.get("family")),
            _text(r["format"]),
            _text(r.get("mesh")),
            "yes" if r["consolidated"] else "no",
            "yes" if r["complete"] else "no",
            ", ".join(r["pointers"]) or "-",
        ])
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
    out = [
        "  ".join(cell.rjust(w) if i in numeric else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))).rstrip()
        for row in lines
    ]
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
        out.append(f"quarantined (failed to load on resume; kept in {LAYOUT.QUARANTINE_DIR}/, never resumed from):")
        for q in quarantined:
            out.append(f"  {q['name']}  step {_text(q['step'])}: {q['reason'] or 'reason not recorded'}")
    for name, pointer in report["pointers"].items():
        if pointer["target"] is None:
            if name != LAYOUT.BEST_EVAL:  # set only where a score is monitored: unset says nothing
                out.append(f"{name}: not set")
        elif not pointer["exists"]:
            out.append(f"{name} -> {pointer['target']} (missing)")
    return "\n".join(out)


def data_position_line(name: str, position: dict[str, Any]) -> str:
    """A streamed corpus's position at checkpoint ``name``: sequences, then per source where it reads and the
    tokens it gave."""
    parts = [f"source {i}: epoch {s.get('epoch')}, shard {s.get('shard')} of {s.get('shards')} ({s.get('path')}) "
             f"row {s.get('row')}, {s.get('tokens')} tokens consumed"
             for i, s in enumerate(position.get("sources") or [])]
    skipped = f", {position['skipped_rows']} bad rows skipped" if position.get("skipped_rows") else ""
    lanes = (f"; {position['lanes']} lanes (this rank {position.get('lanes_read')}), position "
             f"{position.get('position_bytes', 0) / 1024:.1f} KiB") if position.get("lanes") else ""
    return f"data position at {name}: {position.get('sequences')} sequences{skipped}{lanes}; " + "; ".join(parts)


def stages_lines(name: str, meta: dict[str, Any]) -> list[str]:
    """The stages checkpoint ``name``'s metadata lists, one line each (a list that fails its checks: why)."""
    from automodel_ckpt.training.stages import describe, read_history

    try:
        stages, tokens = read_history(meta, f"{name}/{LAYOUT.METADATA_FILE}")
    except UserError as exc:
        return [f"stages at {name}: not readable ({exc})"]
    counted = "" if tokens is None else f", {tokens} tokens trained"
    return [f"stages at {name} (step {meta.get('step')}{counted}):", *describe(stages)]


def _text(value: Any) -> str:
    return "-" if value is None else str(value)
