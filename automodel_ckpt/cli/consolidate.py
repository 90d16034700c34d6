"""`ckpt-train consolidate CHECKPOINT`: export a checkpoint's model to a Hugging Face folder, alone or under torchrun."""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path

from automodel_ckpt.cli.common import VerbParser
from automodel_ckpt.errors import UsageError

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5e9 bytes, ``"5GiB"`` -> 5 * 2**30 (Hugging Face's convention); a plain number is bytes."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise UsageError(f"--max-shard-size: bad size '{text}'; use e.g. 5GB, 500MB or 2GiB")
    unit = (m.group(2) or "").lower().removesuffix("b")
    if unit not in _UNITS:
        raise UsageError(f"--max-shard-size: bad size '{text}'; use e.g. 5GB, 500MB or 2GiB")
    size = int(float(m.group(1)) * _UNITS[unit])
    if size <= 0:
        raise UsageError(f"--max-shard-size: size must be positive, got '{text}'")
    return size


def build_parser() -> VerbParser:
    p = VerbParser("consolidate", "Export a checkpoint's model (sharded safetensors or DCP) to a Hugging Face folder.")
    p.add_argument("model_dir", type=Path, help="checkpoint folder (epoch_E_step_N) or its model/ folder")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: MODEL_DIR/consolidated)")
    p.add_argument("--cast-dtype", default=None, help="bf16, fp16, fp32 or fp64 for floating tensors")
    p.add_argument("--num-threads", type=int, default=5, help="writer threads per process (default 5)")
    p.add_argument("--max-shard-size", default="5GiB", help="file size limit without base layout (default 5GiB)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    max_shard_size = parse_size(args.max_shard_size)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    started_group = False
    try:
        from automodel_ckpt.checkpoint.export.plan import consolidate

        if world_size > 1:
            import torch.distributed as dist

            if not dist.is_initialized():
                dist.init_process_group("gloo")
                started_group = True
            rank, world_size = dist.get_rank(), dist.get_world_size()
        out = consolidate(
            args.model_dir,
            args.out,
            cast_dtype=args.cast_dtype,
            num_threads=args.num_threads,
            max_shard_size=max_shard_size,
            rank=rank,
            world_size=world_size,
            progress=not args.no_progress,
        )
        if rank == 0:
            from automodel_ckpt.checkpoint.manifest import add_files

            add_files(out)  # an export into a published checkpoint joins its manifest, so verify stays clean
            print(f"Hugging Face model written to {out}", flush=True)
    finally:
        if started_group:
            import torch.distributed as dist

            dist.destroy_process_group()
    return 0


def script_main() -> int:
    """``python -m automodel_ckpt.cli.consolidate ARGS``: what consolidate.sh runs (alone or under torchrun)."""
    from automodel_ckpt.cli import exit_code, run

    return exit_code(run(main, sys.argv[1:]))


if __name__ == "__main__":
    sys.exit(script_main())
