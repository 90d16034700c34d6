"""``ckpt-train gc URL``: delete what killed saves left in an object-store run folder, and pieces none references."""

from __future__ import annotations

from typing import Any

from automodel_ckpt.cli.common import VerbParser
from automodel_ckpt.errors import UserError


def build_parser() -> VerbParser:
    p = VerbParser("gc", "Delete the uploads of saves that never committed, and the pieces (checkpoint.incremental) "
                         "that no checkpoint references, from an object-store checkpoint_dir.")
    p.add_argument("checkpoint_dir", help="the run's checkpoint.checkpoint_dir on an object store (s3://BUCKET/RUN)")
    p.add_argument("--min-age-minutes", type=float, default=60.0,
                   help="keep leftovers and unreferenced pieces written more recently than this: a save of a live "
                        "run may still be uploading them (default 60; 0 deletes every one)")
    p.add_argument("--dry-run", action="store_true", help="list what would be deleted, delete nothing")
    p.add_argument("--break-lease", action="store_true",
                   help="also remove the run folder's lease (only when the run holding it is dead: the next run "
                        "then starts at once instead of waiting for the lease to expire)")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    from automodel_ckpt.checkpoint import is_url, open_store_run

    if not is_url(args.checkpoint_dir):
        raise UserError(f"gc: '{args.checkpoint_dir}' is a local folder; a local run's interrupted saves "
                        "(.staging-*) are removed by its next save")
    run = open_store_run(args.checkpoint_dir, "gc")
    url = run.url
    if args.break_lease and not args.dry_run:
        lease = run.break_lease()
        holder = (lease or {}).get("holder") or {}
        print(f"no lease on {url}" if lease is None else
              f"removed the lease of {url} (held by host {holder.get('host', '?')}, pid {holder.get('pid', '?')})")
    min_age, dry = args.min_age_minutes * 60, args.dry_run
    stale = run.gc(min_age, dry_run=dry)
    for name in stale:
        print(f"{'would delete' if dry else 'deleted'} {run.store.url_of(name)}/ (an upload that never committed)")
    if not dry:
        print(f"gc: {len(stale)} leftover(s) deleted from {url}")
    _pieces(run, min_age, dry_run=dry, gone=stale if dry else None)
    return 0


def _pieces(run: Any, min_age_seconds: float, *, dry_run: bool, gone: list[str] | None = None) -> None:
    """The pieces no checkpoint references (after the leftovers, whose references are gone with them; ``gone``:
    those a dry run only lists)."""
    keys = run.gc_pieces(min_age_seconds, dry_run=dry_run, gone=gone or ())
    if keys is None:
        print(f"gc: kept the unreferenced pieces of {run.url}: a live run holds its lease (its next save collects "
              "them)")
        return
    for key in keys:
        print(f"{'would delete' if dry_run else 'deleted'} {run.piece_url(key)} (a piece no "
              "checkpoint references)")
    if not dry_run:
        print(f"gc: {len(keys)} unreferenced piece(s) deleted from {run.url}")
