"""`ckpt-train consolidate CHECKPOINT`: export a checkpoint's model to a Hugging Face folder, alone or under torchrun."""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path

from automodel_ckpt.cli.common import VerbParser
from automodel_ckpt.errors import UsageError
from automodel_ckpt.ondisk import CheckpointFolder, HFFolder, add_files_to_manifest

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5e9 bytes, ``"5GiB"`` -> 5 * 2**30 (Hugging Face's convention); a plain number is bytes."""
    m = _SIZE_RE.match(str(text))
    unit = (m.group(2) or "").lower().removesuffix("b") if m else None
    if unit not in _UNITS:
        raise UsageError(f"--max-shard-size: bad size '{text}'; use e.g. 5GB, 500MB or 2GiB")
    size = int(float(m.group(1)) * _UNITS[unit])
    if size <= 0:
        raise UsageError(f"--max-shard-size: size must be positive, got '{text}'")
    return size


def build_parser() -> VerbParser:
    p = VerbParser("consolidate", "Export a checkpoint's model (sharded safetensors or DCP) to a Hugging Face folder.")
    p.add_argument("model_dir", help="checkpoint folder (epoch_E_step_N) or its model/ folder; or its object store "
                                     "URL (s3://BUCKET/RUN/epoch_E_step_N)")
    p.add_argument("--out", default=None, help="output folder or object store URL (default: MODEL_DIR/consolidated; "
                                               "required for a checkpoint on an object store)")
    p.add_argument("--cast-dtype", default=None, help="bf16, fp16, fp32 or fp64 for floating tensors")
    p.add_argument("--num-threads", type=int, default=5, help="writer threads per process (default 5)")
    p.add_argument("--max-shard-size", default="5GiB", help="file size limit without base layout (default 5GiB)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--ema", action="store_true", help="export the checkpoint's EMA weights (training.ema_decay) "
                                                      "instead (default --out: MODEL_DIR/consolidated_ema)")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    max_shard_size = parse_size(args.max_shard_size)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    started_group = False
    model_dir, out_url = _localize(args, world_size)
    out_dir = Path(args.out) if args.out and not out_url else None
    model_dir, out_dir, metadata_dir = _ema_source(model_dir, out_dir) if args.ema else (model_dir, out_dir, None)
    tmp = None
    if out_url:
        import tempfile

        tmp = tempfile.TemporaryDirectory(prefix="consolidated-")
        out_dir = Path(tmp.name) / "consolidated"
    try:
        from automodel_ckpt.export import consolidate

        if world_size > 1:
            import torch.distributed as dist

            if not dist.is_initialized():
                dist.init_process_group("gloo")
                started_group = True
            rank, world_size = dist.get_rank(), dist.get_world_size()
        out = consolidate(model_dir, out_dir, cast_dtype=args.cast_dtype, num_threads=args.num_threads,
                          max_shard_size=max_shard_size, rank=rank, world_size=world_size,
                          progress=not args.no_progress, metadata_dir=metadata_dir)
        if rank == 0 and out_url:
            from automodel_ckpt.checkpoint import upload_folder

            upload_folder(out, out_url, last=(HFFolder.config,))
            print(f"Hugging Face model written to {out_url}", flush=True)
        elif rank == 0:
            add_files_to_manifest(out)  # an export into a published checkpoint joins its manifest, so verify stays clean
            print(f"Hugging Face model written to {out}", flush=True)
    finally:
        if tmp is not None:
            tmp.cleanup()
    if started_group:  # a failed rank leaves without teardown (cli.exit_code): its peers may be gone already
        from automodel_ckpt.distributed.env import shutdown_distributed

        shutdown_distributed()
    return 0


def _ema_source(model_dir: Path, out_dir: Path | None) -> tuple[Path, Path, Path]:
    """``--ema``: the checkpoint's ``ema/`` shards, described by its ``model/``'s metadata, exported to
    ``model/consolidated_ema`` unless ``--out`` says where."""
    ckpt = CheckpointFolder(model_dir.parent if model_dir.name == CheckpointFolder.model else model_dir)
    ema = ckpt.ema.path
    if not ema.is_dir() or ema.is_symlink():
        raise UsageError(f"consolidate --ema: '{ckpt.path}' holds no EMA weights ({CheckpointFolder.ema}/ is written "
                         "by a run with training.ema_decay)")
    return ema, out_dir or ckpt.model.consolidated_ema.path, ckpt.model.path


def _localize(args: object, world_size: int) -> tuple[Path, str | None]:
    """The local model folder to read (an object store checkpoint's model/ is downloaded first) and the output URL."""
    from automodel_ckpt.checkpoint import is_url, open_for_reading

    source, out = str(args.model_dir), args.out
    out_url = str(out) if out is not None and is_url(out) else None
    if not is_url(source):
        return Path(source), out_url
    if world_size > 1:
        raise UsageError("consolidate: a checkpoint on an object store is exported by one process; run it without "
                         "torchrun")
    if out is None:
        raise UsageError(f"consolidate: give --out (a local folder or an object store URL) for '{source}'")
    checkpoint = source.rstrip("/").removesuffix("/" + CheckpointFolder.model)
    local = open_for_reading(checkpoint, fetch_all=True, only=CheckpointFolder.model, key="consolidate")
    return CheckpointFolder(local).model.path, out_url


def script_main() -> int:
    """``python -m automodel_ckpt.cli.consolidate ARGS``: what consolidate.sh runs (alone or under torchrun)."""
    from automodel_ckpt.cli import exit_code, run

    return exit_code(run(main, sys.argv[1:]))


if __name__ == "__main__":
    sys.exit(script_main())
