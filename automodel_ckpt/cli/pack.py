"""`ckpt-train pack SRC --out FILE.tar`: one uncompressed tar of a checkpoint's export, an export or an adapter folder."""

from __future__ import annotations

import signal
from pathlib import Path

from automodel_ckpt.ondisk import CheckpointFolder
from automodel_ckpt.cli.common import VerbParser


def build_parser() -> VerbParser:
    p = VerbParser("pack", "Write a checkpoint's Hugging Face export (made on the way), an export folder or a PEFT "
                           "adapter folder as one tar file that plain tar unpacks and restore_from reads in place.")
    p.add_argument("src", help="a checkpoint folder (epoch_E_step_N), an export folder or an adapter folder")
    p.add_argument("--out", default=None, help="the archive to write, a path or an object store URL "
                                               "(s3://BUCKET/KEY.tar; default: SRC.tar beside SRC); replaced if it "
                                               "exists")
    p.add_argument("--cast-dtype", default=None, help="bf16, fp16, fp32 or fp64 for a checkpoint's floating tensors")
    p.add_argument("--num-threads", type=int, default=5, help="writer threads (default 5)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    from automodel_ckpt.checkpoint import is_url, streamed_object
    from automodel_ckpt.export import pack, pack_into, pack_summary as summary

    src = Path(args.src)
    options = {"cast_dtype": args.cast_dtype, "num_threads": max(1, args.num_threads), "progress": not args.no_progress}
    if args.out and is_url(args.out):
        signal.signal(signal.SIGTERM, _interrupted)  # aborts the upload as Ctrl-C does: nothing left at the URL
        out = args.out
        table = pack_into(src, lambda size: streamed_object(out, size, key="--out"), **options)
    else:
        out = Path(args.out) if args.out else CheckpointFolder(src).archive
        table = pack(src, out, **options)
    print(f"archive written to {out} ({summary(table)})", flush=True)
    return 0


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
