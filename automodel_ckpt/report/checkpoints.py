"""The report's tables: checkpoints (size, save time, verify state, why retention keeps it), data, cost, lineage."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from automodel_ckpt.errors import UserError
from automodel_ckpt.ondisk import (CONFIG_FILE_LIMIT, Archive, CheckpointFolder, RetentionPolicy, is_count, read_yaml,
                                   verify_manifest)
from automodel_ckpt.report.curves import MAX_SERIES, points
from automodel_ckpt.report.html import Markup, chart, el, finite, lines, none, table
from automodel_ckpt.report.runinfo import data_position_line
from automodel_ckpt.sizes import human_size
from automodel_ckpt.tracking import cost_report, render_cost

_MAX_KEEP_STEPS = 10_000


def retention(run_dir: Path, rows: list[dict[str, Any]]) -> dict[str, str]:
    """Why retention keeps each complete checkpoint, by the rules of the newest one's config.yaml."""
    complete = [r for r in rows if r["complete"] and r["step"] is not None]
    if not complete:
        return {}
    try:
        cfg = read_yaml(CheckpointFolder(Path(run_dir) / complete[-1]["name"]).config, "a checkpoint's config",
                        CONFIG_FILE_LIMIT)
        cfg = cfg.get("checkpoint") if isinstance(cfg, dict) else None
    except (OSError, UserError):
        cfg = None
    cfg = cfg if isinstance(cfg, dict) else {}
    keep = cfg.get("keep_steps") if isinstance(cfg.get("keep_steps"), list) else []
    recent, top = (v if is_count(v) else None for v in (cfg.get("max_recent_checkpoints"), cfg.get("save_top_k")))
    policy = RetentionPolicy(recent, top, "max" if cfg.get("mode") == "max" else "min",
                             frozenset(s for s in keep[:_MAX_KEEP_STEPS] if is_count(s)),
                             str(cfg.get("monitor") or "val_loss"))

    def metric(r: dict[str, Any]) -> float | None:
        extra = (r.get("metadata") or {}).get("extra")
        scores = extra.get("val_metrics") if isinstance(extra, dict) else None
        return finite(r["val_loss"] if policy.monitor == "val_loss" else scores.get(policy.monitor)
                      if isinstance(scores, dict) else None)

    why = policy.reasons([(r["name"], r["step"], metric(r)) for r in complete])
    return {r["name"]: "; ".join([f"{p} points at it" for p in r["pointers"]] + why[r["name"]])
            or ("-" if policy.prunes else "no rule deletes checkpoints") for r in complete}


def _verified(row: dict[str, Any], run_dir: Path) -> str:
    if not row["complete"]:
        return "being written"
    report = verify_manifest(Path(run_dir) / row["name"], checksums=False, unexpected=False)
    return report.problem or (f"sizes match ({len(report.verdicts)} files)" if report.ok else
                              f"{len(report.bad)} files differ from the manifest")


def checkpoints(run: dict[str, Any]) -> Markup:
    listing, saves = run["checkpoints"], run["logs"]["events"].saves
    rows = listing["checkpoints"]
    if not rows and not listing["quarantined"]:
        return none("no checkpoint in this run folder")
    why = retention(run["dir"], rows)
    body = []
    for r in rows:
        save = saves.get(r["step"], {})
        blocked, background = finite(save.get("blocked_s")), finite(save.get("background_s"))
        total = None if blocked is None else blocked + (background or 0.0)
        body.append([r["name"], r["step"], human_size(r["size_bytes"]), "-" if blocked is None else f"{blocked:.3f} s",
                     "-" if total is None else f"{total:.3f} s", _verified(r, run["dir"]),
                     "yes" if r["consolidated"] else "no", ", ".join(r["pointers"]) or "-", why.get(r["name"], "-")])
    parts = [table(["checkpoint", "step", "size", "blocking save", "total save", "verify (sizes)", "consolidated",
                    "pointers", "why retention keeps it"], body)]
    quarantined = listing["quarantined"]
    if quarantined:
        parts += [el("h3", "quarantined (failed to load on resume; never resumed from)"),
                  table(["checkpoint", "step", "reason"], [[q["name"], q["step"], q["reason"]] for q in quarantined])]
    if run["deleted"]:
        parts.append(el("p", "deleted by retention (saved, no longer in the folder): steps "
                        + ", ".join(map(str, run["deleted"][:200]))))
    return Markup("".join(parts))


def data(run: dict[str, Any]) -> Markup:
    train, rows = run["logs"]["train"], run["checkpoints"]["checkpoints"]
    positioned = [r for r in rows if isinstance(r.get("data_position"), dict)]
    position = positioned[-1]["data_position"] if positioned else {}
    sources = position.get("sources") if isinstance(position.get("sources"), list) else []
    counts = [r["source_tokens"] for r in train if isinstance(r.get("source_tokens"), list)]
    width = min(max((len(c) for c in counts), default=0), MAX_SERIES)
    named = [s.get("path") if isinstance(s, dict) else None for s in sources[:width]]
    series = {f"source {i}" + (f": {named[i]}" if i < len(named) and named[i] else ""):
              [(float(r["step"]), v) for r in train if isinstance(r.get("source_tokens"), list)
               and len(r["source_tokens"]) > i and (v := finite(r["source_tokens"][i])) is not None]
              for i in range(width)}
    parts = [chart("tokens per source", series) if series else none("no tokens per source (a map-style dataset)"),
             chart("epoch", {"epoch": points(train, "epoch")}, height=140)]
    if positioned:
        try:
            parts.append(el("p", data_position_line(positioned[-1]["name"], position)))
        except (AttributeError, TypeError, ValueError):
            parts.append(none(f"the data position of {positioned[-1]['name']} is not readable"))
    else:
        parts.append(none("no checkpoint records a data position (a streamed corpus's)"))
    skipped = [v for r in train if (v := r.get("skipped_rows")) is not None]
    parts.append(el("p", f"skipped rows: {skipped[-1]}") if skipped else none("no skipped rows logged"))
    return Markup("".join(parts))


def cost(run: dict[str, Any]) -> Markup:
    ev = run["logs"]["events"]
    if not ev.costs.launches:
        return none("no events.jsonl records: the run's checkpoint costs were not recorded")
    parts = [lines(render_cost(cost_report(ev.costs)).splitlines())]
    if ev.intervals:
        parts += [el("h3", "interval decisions (ckpt_every_steps: auto)"),
                  table(["step", "event", "every steps", "why"], [[i.get("step"), i.get("event"), i.get("every_steps"),
                                                                   i.get("text")] for i in ev.intervals[-200:]])]
    parts += [el("h3", "launches"), table(["started at step", "resumed from"],
                                          [[s.get("step"), s.get("resumed_from") or "-"] for s in ev.starts[-200:]])]
    return Markup("".join(parts))


def lineage(run: dict[str, Any]) -> Markup:
    from automodel_ckpt.export import lineage_chain
    from automodel_ckpt.training.stages import describe

    rows = [r for r in run["checkpoints"]["checkpoints"] if r["complete"]]
    parts = []
    if rows:
        try:
            parts.append(lines(lineage_chain(Path(run["dir"]) / rows[-1]["name"])))
        except (OSError, UserError, ValueError) as exc:
            parts.append(none(f"the lineage of {rows[-1]['name']} is not readable: {exc}"))
    else:
        parts.append(none("no complete checkpoint: no lineage recorded"))
    parts.append(lines(["stages:", *describe(run["stages"])]) if run["stages"] else
                 none(run["stages_problem"] or "one stage: the recipe as written (no stages listed)"))
    models = [(r["name"], CheckpointFolder(Path(run["dir"]) / r["name"]).model) for r in rows]
    exports = [f"{name}/{what}" for name, model in models for what, path in
               (("consolidated (a Hugging Face folder)", model.consolidated.path),
                ("consolidated EMA", model.consolidated_ema.path)) if path.is_dir() and not path.is_symlink()]
    exports += [f"{r['name']}{Archive.SUFFIX}" for r in rows
                if (Path(run["dir"]) / f"{r['name']}{Archive.SUFFIX}").is_file()]
    parts.append(el("ul", [el("li", e) for e in exports]) if exports else none("no export in the run folder"))
    return Markup("".join(parts))
