"""`ckpt-train diff A B`: what differs between two models' tensors, and two checkpoints' recipes and counters."""

from __future__ import annotations

import json
from pathlib import Path

from automodel_ckpt.cli.common import VerbParser
from automodel_ckpt.errors import CheckpointError, UsageError, UserError, first_line

_ORDER = ("changed", "only_a", "only_b", "close", "equal")


def build_parser() -> VerbParser:
    from automodel_ckpt.export import export_targets

    files = " or ".join(t.noun for t in export_targets() if t.noun)  # what the export targets' files are
    p = VerbParser("diff", "Compare two models tensor by tensor (checkpoints at any world size or format, export "
                           f"folders, archives, int8 folders, adapters, {files}), one tensor in memory at a time. "
                           "Exit 0 when equal, 1 when something changed, 2 on error.")
    p.add_argument("a", type=Path, help=f"a checkpoint, an export folder, an archive, an int8 folder, an adapter "
                                        f"folder or {files}")
    p.add_argument("b", type=Path, help="the same kinds")
    p.add_argument("--tolerance", type=float, default=0.0, metavar="T",
                   help="the largest |difference| still counted as equal ('close'; default 0: bitwise)")
    p.add_argument("--json", action="store_true", help="print one JSON object: tensors by name and a summary")
    p.add_argument("--all", action="store_true", help="list every tensor, the equal ones too")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if not args.tolerance >= 0:
        raise UsageError(f"--tolerance: expected a number >= 0, got {args.tolerance}")
    from automodel_ckpt.evaluation.diff import diff

    try:
        report = diff(args.a, args.b, tolerance=args.tolerance)
    except UserError as exc:  # as diff(1): 2 on error, 1 only for "different"
        exc.exit_code = 2
        raise
    except MemoryError as exc:
        raise UsageError(f"could not allocate the memory one tensor needs ({exc}); run it where there is more") \
            from None
    except OSError as exc:  # a file of either side that cannot be read (no permission, an I/O error, gone)
        where = f"'{exc.filename}'" if exc.filename else "a file of either side"
        failed = CheckpointError(f"cannot read {where}: {exc.strerror or first_line(exc)}")
        failed.exit_code = 2
        raise failed from None
    if args.json:
        print(json.dumps(report.as_json(), indent=1))
        return 0 if report.equal else 1
    for status in _ORDER:
        for name, d in report.tensors.items():
            if d.status != status or (status == "equal" and not args.all):
                continue
            numbers = "" if d.max_abs is None else \
                f"  max|Δ| {d.max_abs:.3g}  rel L2 {d.rel_l2:.3g}  changed {d.changed_fraction:.1%}"
            print(f"{status:8s} {name}{numbers}{'  ' + d.note if d.note else ''}")
    print("By module group:")
    for name, counts in sorted(report.groups().items(), key=lambda kv: _group_order(kv[0])):
        shown = sorted(counts.items(), key=lambda kv: _ORDER.index(kv[0]))
        print(f"  {name:14s} " + ", ".join(f"{n} {s}" for s, n in shown))
    for title, rows in (("Recipe keys that differ", report.recipe), ("Counters", report.counters)):
        if rows:
            print(f"{title}:")
            for key, (left, right) in rows.items():
                print(f"  {key}: {left!r} -> {right!r}")
    totals = {s: sum(d.status == s for d in report.tensors.values()) for s in _ORDER}
    print(("Equal" if report.equal else "Different") + f": {len(report.tensors)} tensors, " +
          ", ".join(f"{n} {s}" for s, n in totals.items() if n))
    return 0 if report.equal else 1


def _group_order(name: str) -> tuple[int, int, str]:
    if name.startswith("block "):
        return 1, int(name.split()[1]), name
    return {"embeddings": 0, "head": 2, "adapters": 3, "tower": 4, "projector": 5}.get(name, 6), 0, name
