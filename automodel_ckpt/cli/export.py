"""`ckpt-train export SRC --to gguf|int8`: a quantized model for llama.cpp (one GGUF file) or vLLM (an int8 folder)."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from automodel_ckpt.ondisk import layout
from automodel_ckpt.cli.common import VerbParser, human_size
from automodel_ckpt.errors import CheckpointError, UsageError

_TARGETS = ("gguf", "int8")


def build_parser() -> VerbParser:
    p = VerbParser("export", "Write a checkpoint, an export folder or an archive as a quantized model: one GGUF file "
                             "for llama.cpp (--to gguf) or a compressed-tensors int8 folder for vLLM (--to int8).")
    p.add_argument("src", help="a checkpoint folder (epoch_E_step_N), a Hugging Face folder or an archive (.tar)")
    p.add_argument("--to", default="gguf", choices=_TARGETS, help="gguf (default) or int8")
    p.add_argument("--type", default="q8_0", help="GGUF storage type: bf16, f16, q8_0 (default) or q4_0")
    p.add_argument("--scheme", default="w8a8", help="int8 scheme: w8a8 (default: int8 weights and activations) "
                                                    "or w4a16 (int4 weights)")
    p.add_argument("--calibrate", type=int, default=0, metavar="N",
                   help="int8: N examples for static activation scales (default 0: dynamic per-token scales)")
    p.add_argument("--out", default=None, help="the GGUF file or int8 folder to write (default: beside SRC, "
                                               "SRC-TYPE.gguf or SRC-int8-SCHEME/); replaced if it exists")
    p.add_argument("--adapter", action="store_true", help="gguf, a LoRA checkpoint: its adapter as a GGUF LoRA "
                                                          "adapter (llama.cpp --lora) instead of merged")
    p.add_argument("--dry-run", action="store_true", help="print the plan (family, tensors, bytes out), write nothing")
    p.add_argument("--num-threads", type=int, default=min(4, os.cpu_count() or 1),
                   help="gguf: tensors converted at once (default: up to 4; memory: that many of the largest tensor)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _export(args)
    except OSError as exc:  # a file that cannot be read or written, where no reader named it already
        raise CheckpointError(f"export: {exc.strerror or exc}" + (f" ({exc.filename})" if exc.filename else "")) from None


def _export(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    src = Path(args.src)
    if args.calibrate and args.to != "int8":
        raise UsageError("--calibrate applies to --to int8 only")
    if args.calibrate < 0:
        raise UsageError(f"--calibrate: expected a number of examples >= 0, got {args.calibrate}")
    from automodel_ckpt.ondisk import open_model

    where = src.absolute()  # beside SRC as named (a link stays a link)
    stem = where.name.removesuffix(layout.ARCHIVE_SUFFIX)
    if args.adapter:
        if args.to != "gguf" or args.dry_run:
            raise UsageError("--adapter applies to --to gguf (without --dry-run)")
        from automodel_ckpt.ondisk import write_gguf_adapter

        out = Path(args.out) if args.out else where.parent / f"{stem}-lora-{args.type}{layout.GGUF_SUFFIX}"
        done = write_gguf_adapter(src, out, args.type)
        print(f"GGUF LoRA adapter written to {out} ({human_size(done['bytes'])}, {done['factors']} factors, rank "
              f"{done['rank']}, alpha {done['alpha']:g}; apply it to the GGUF of {done['base']})", flush=True)
        return 0
    if args.to == "gguf":
        from automodel_ckpt.ondisk import plan_gguf, write_gguf

        out = Path(args.out) if args.out else where.parent / f"{stem}-{args.type}{layout.GGUF_SUFFIX}"
        with open_model(src) as source:
            plan = plan_gguf(source, args.type)
            print(plan.describe(source), flush=True)
            if args.dry_run:
                print(f"would write {out}", flush=True)
                return 0
            done = write_gguf(source, plan, out, progress=not args.no_progress, num_threads=max(1, args.num_threads))
        print(f"GGUF written to {out} ({human_size(done['bytes'])}, {done['tokenizer']} tokenizer, "
              f"{done['seconds']:.2f} s)", flush=True)
        return 0
    from automodel_ckpt.ondisk import plan_int8, write_int8

    out = Path(args.out) if args.out else where.parent / f"{stem}-{layout.INT8_EXPORT_DIR}-{args.scheme}"
    with open_model(src) as source:
        examples = _validation_examples(src, args.calibrate, source.side_dir) if args.calibrate else None
        plan = plan_int8(source, args.scheme, examples)
        print(plan.describe(source), flush=True)
        if args.dry_run:
            print(f"would write {out}", flush=True)
            return 0
        done = write_int8(source, plan, out, progress=not args.no_progress)
    print(f"int8 model written to {out} ({human_size(done['bytes'])}, {done['seconds']:.2f} s)", flush=True)
    return 0


def _validation_examples(src: Path, n: int, tokenizer_dir: Path) -> list[list[int]]:
    """The token ids of the first ``n`` rows of the validation data of the recipe that made the checkpoint ``src``
    (its ``config.yaml``; the training data where the recipe holds none out), tokenized as for training."""
    from transformers import AutoTokenizer

    from automodel_ckpt.config.loader import load_config
    from automodel_ckpt.config.schema import RecipeConfig
    from automodel_ckpt.data.pipeline import prepare_data

    recipe = next((p / layout.CONFIG_FILE for p in (src, src.parent) if (p / layout.CONFIG_FILE).is_file()), None)
    if recipe is None:
        raise UsageError(f"--calibrate needs a checkpoint (its {layout.CONFIG_FILE} names the validation data); "
                         f"'{src}' has none")
    cfg = load_config(recipe, [], RecipeConfig)
    prepared = prepare_data(cfg, AutoTokenizer.from_pretrained(tokenizer_dir))
    rows = prepared.validation if prepared.validation is not None and len(prepared.validation) else prepared.train
    batch = rows.batch(list(range(min(n, len(rows)))))
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    return [ids[:length].tolist() for ids, length in zip(batch["input_ids"], lengths)]
