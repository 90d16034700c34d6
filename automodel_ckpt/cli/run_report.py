"""``ckpt-train report RUN_DIR [-o FILE.html]``: one self-contained HTML page of a run (docs/report.md)."""

from __future__ import annotations

from pathlib import Path

from automodel_ckpt.cli.common import VerbParser
from automodel_ckpt.ondisk import RunFolder


def build_parser() -> VerbParser:
    p = VerbParser("report", "One self-contained HTML page of a run: curves, checkpoints, data, cost, lineage.")
    p.add_argument("run_dir", help="the run folder (checkpoint.checkpoint_dir): a path or an object store URL")
    p.add_argument("-o", "--out", type=Path, default=None,
                   help="the page to write (default: RUN_DIR/report.html; ./report.html for a URL)")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    from automodel_ckpt.checkpoint import is_url, open_for_reading
    from automodel_ckpt.report import write

    run_dir = open_for_reading(args.run_dir, key="report")
    out = args.out or (Path(RunFolder.report) if is_url(args.run_dir) else None)
    print(f"wrote {write(run_dir, out)}")
    return 0
