"""``ckpt-train verify PATH``: check one checkpoint, or every checkpoint and pointer of a checkpoint_dir.

Prints one verdict per file (ok / size mismatch / checksum mismatch / missing / unexpected file / unreadable)
and exits 0 only when every file matches its checkpoint's manifest and every pointer designates a checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path

from automodel_ckpt.ondisk import (CHECKSUM_MISMATCH, UNEXPECTED_FILE, CheckpointFolder, ManifestReport, RunFolder,
                                   pointer_targets, scan_checkpoints, verify_manifest)
from automodel_ckpt.cli.common import VerbParser, human_size
from automodel_ckpt.errors import UserError

FAILED = 1


def build_parser() -> VerbParser:
    p = VerbParser("verify", "Check checkpoint files against their manifest.json (sizes and checksums) and the pointers.")
    p.add_argument("path", help="a checkpoint folder, or a checkpoint_dir (every checkpoint in it); a path or an "
                                "object store URL (its files are downloaded, then checked); or an archive "
                                "(ckpt-train pack), read in place")
    p.add_argument("--quiet", "-q", action="store_true", help="print only problems and the summary")
    p.add_argument("--sizes-only", action="store_true", help="skip checksums (fast: no file is read)")
    p.add_argument("--export", action="store_true",
                   help="check the HF export of CHECKPOINT (or the export folder itself) instead: it reloads in "
                        "transformers with no missing or unexpected keys, equals the shards, and has the base's "
                        "names, shapes and dtypes")
    p.add_argument("--threads", type=int, default=min(4, os.cpu_count() or 1), help="files hashed in parallel")
    return p


def is_checkpoint(path: Path) -> bool:
    """Whether ``path`` looks like one checkpoint folder (rather than a checkpoint_dir)."""
    ckpt = CheckpointFolder(path)
    return ckpt.manifest.exists() or ckpt.metadata.exists() or RunFolder.parse_default_name(path.name) is not None \
        or ckpt.model.is_dir()


def verify_checkpoint(path: Path, *, checksums: bool, threads: int, quiet: bool) -> bool:
    return show(verify_manifest(path, checksums=checksums, threads=max(1, threads)), "checkpoint", checksums, quiet)


def show(report: ManifestReport, kind: str, checksums: bool, quiet: bool) -> bool:
    """Print one verdict per file (``quiet``: problems only) and the outcome; whether every file matched."""
    n_files = len([v for v in report.verdicts if v.status != UNEXPECTED_FILE])
    head = f"{kind} {report.checkpoint}"
    if report.problem is None:
        what = "sizes" if not checksums else report.algorithm
        head += f" ({n_files} files, {human_size(report.total_bytes)}, layout {CheckpointFolder.VERSION}, {what})"
    print(head)
    width = max(len(CHECKSUM_MISMATCH), len(UNEXPECTED_FILE))
    for v in report.verdicts:
        if quiet and v.ok:
            continue
        detail = f"  ({v.detail})" if v.detail else ""
        print(f"  {v.status:<{width}}  {v.path}{detail}")
    if report.problem is not None:
        print(f"  FAILED: {report.problem}")
    elif report.ok:
        print(f"  OK: {n_files} files match the manifest")
    else:
        print(f"  FAILED: {len(report.bad)} problem(s) in {n_files} listed files")
    return report.ok


def verify_dir(root: Path, *, checksums: bool, threads: int, quiet: bool) -> bool:
    refs = scan_checkpoints(root)
    pointers = pointer_targets(root)
    names = {r.name for r in refs}
    if not refs and all(t is None for t in pointers.values()):
        raise UserError(f"'{root}' is neither a checkpoint nor a checkpoint_dir (no checkpoints or pointers in it)")
    print(f"checkpoint_dir {root}: {len(refs)} checkpoint(s)")
    bad = [r.name for r in refs if not verify_checkpoint(r.path, checksums=checksums, threads=threads, quiet=quiet)]
    pointer_problems = 0
    for pointer, target in pointers.items():
        if target is None:
            continue
        if target not in names:
            print(f"pointer {pointer} -> {target}: FAILED (not a checkpoint in {root})")
            pointer_problems += 1
        elif target in bad:
            print(f"pointer {pointer} -> {target}: FAILED (that checkpoint is damaged)")
            pointer_problems += 1
        else:
            print(f"pointer {pointer} -> {target}: ok")
    latest = pointers[RunFolder.latest]
    if refs and latest in names and refs[-1].name != latest:
        print(f"note: LATEST is behind the newest checkpoint {refs[-1].name} (a run stopped between publishing it "
              "and moving LATEST); resume picks the newest")
    if refs and latest is None:
        print(f"note: no LATEST pointer; resume picks the newest checkpoint {refs[-1].name}")
    for leftover in sorted(root.iterdir()):
        if leftover.is_dir() and RunFolder.is_staging(leftover.name):
            print(f"note: {leftover.name} is an interrupted save: never loaded, removed by the next save")
    ok = not bad and not pointer_problems
    if ok:
        print(f"verify: OK ({len(refs)} checkpoint(s))")
    else:
        parts = [f"{len(bad)} of {len(refs)} checkpoint(s) damaged"] if bad else []
        parts += [f"{pointer_problems} pointer(s) invalid"] if pointer_problems else []
        print("verify: FAILED (" + ", ".join(parts) + ")")
    return ok


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    from automodel_ckpt.checkpoint import open_for_reading
    from automodel_ckpt.export import identify, is_archive, verify_archive

    path = open_for_reading(args.path, fetch_all=True, key="verify")  # a URL's archive: downloaded once
    target = identify(path)  # one file an export target wrote, as the registry recognises it: checked by its target
    if target is not None:
        ok = target.verify(path, decode=not args.sizes_only)
    elif is_archive(path) and not args.export:  # every member against its manifest, read in place
        ok = show(verify_archive(path, checksums=not args.sizes_only), "archive", not args.sizes_only, args.quiet)
    elif not path.exists():
        raise UserError(f"'{path}' does not exist")
    elif not path.is_dir():
        raise UserError(f"'{path}' is not a folder; give a checkpoint folder or a checkpoint_dir")
    elif args.export:
        from automodel_ckpt.export import print_report, verify_export

        report = verify_export(path)
        print_report(report)
        ok = report.ok
    elif is_checkpoint(path):
        ok = verify_checkpoint(path, checksums=not args.sizes_only, threads=args.threads, quiet=args.quiet)
    else:  # a checkpoint_dir prints its own verdict line
        return 0 if verify_dir(path, checksums=not args.sizes_only, threads=args.threads, quiet=args.quiet) else FAILED
    print(f"verify: {'OK' if ok else 'FAILED'}")
    return 0 if ok else FAILED
