"""`ckpt-train average CK1 CK2 ... | --last K RUN_DIR`: the streamed mean of checkpoints' weights, as an HF folder."""

from __future__ import annotations

from pathlib import Path

from automodel_ckpt.cli.common import VerbParser, human_size
from automodel_ckpt.errors import UsageError, UserError


def build_parser() -> VerbParser:
    p = VerbParser("average", "Average the model weights of several checkpoints (uniform or weighted), tensor by "
                              "tensor, into a Hugging Face folder (an adapter folder for LoRA checkpoints).")
    p.add_argument("sources", nargs="*", type=Path,
                   help="checkpoints (any world size and format), export folders or archives of one model")
    p.add_argument("--last", type=int, default=None, metavar="K", help="the K newest checkpoints of RUN_DIR")
    p.add_argument("--weights", nargs="+", default=None, help="one weight per checkpoint (normalized to sum 1); "
                                                              "default: uniform")
    p.add_argument("--out", type=Path, default=None, help="output folder (new or empty; required)")
    p.add_argument("--dtype", default=None, help="bf16, fp16, fp32 or fp64 for the written floating tensors "
                                                 "(default: each tensor's dtype in the Hugging Face export)")
    return p


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.out is None:
        parser.error("the following arguments are required: --out")
    from automodel_ckpt.evaluation.average import average, last_checkpoints, parse_weights
    from automodel_ckpt.export import export_lineage, parse_cast_dtype, write_lineage_file

    if args.last is not None:
        if len(args.sources) != 1:
            parser.error("--last K takes one RUN_DIR (the run's checkpoint_dir), not a list of checkpoints")
        sources = last_checkpoints(args.sources[0], args.last)
    else:
        sources = list(args.sources)
    if len(sources) < 2:
        parser.error("give at least two checkpoints, or --last K RUN_DIR with K >= 2")
    weights = parse_weights(args.weights, len(sources))
    try:
        dtype = parse_cast_dtype(args.dtype)
    except UserError:
        raise UsageError(f"--dtype: unknown dtype '{args.dtype}'; use bf16, fp16, fp32 or fp64") from None
    report = average(sources, weights, args.out, dtype=dtype)
    write_lineage_file(report.out, export_lineage(list(report.sources)))  # every source, by path and fingerprint
    for source, weight in zip(report.sources, report.weights):
        print(f"  {weight:.4f}  {source}")
    what = "adapter" if report.kind == "adapter" else "Hugging Face model"
    print(f"Averaged {len(report.sources)} checkpoints ({report.tensors} tensors, {human_size(report.bytes_written)})"
          f" into the {what} folder {report.out}", flush=True)
    return 0
