"""`ckpt-train export SRC --to gguf|int8`: a quantized model for llama.cpp (one GGUF file) or vLLM (an int8 folder)."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from automodel_ckpt.ondisk import LAYOUT, LOG_LINE_LIMIT, open_regular
from automodel_ckpt.cli.common import VerbParser, human_size
from automodel_ckpt.errors import CheckpointError, UsageError, first_line

_TARGETS = ("gguf", "int8", "hf-trainer")


def build_parser() -> VerbParser:
    p = VerbParser("export", "Write a checkpoint, an export folder or an archive as a quantized model: one GGUF file "
                             "for llama.cpp (--to gguf) or a compressed-tensors int8 folder for vLLM (--to int8).")
    p.add_argument("src", help="a checkpoint folder (epoch_E_step_N), a Hugging Face folder or an archive (.tar)")
    p.add_argument("--to", default="gguf", choices=_TARGETS, help="gguf (default), int8, or hf-trainer (a checkpoint "
                                                                  "as an HF Trainer checkpoint-N/ folder that "
                                                                  "Trainer.train resumes)")
    p.add_argument("--type", default="q8_0", help="GGUF storage type: bf16, f16, q8_0 (default) or q4_0")
    p.add_argument("--scheme", default="w8a8", help="int8 scheme: w8a8 (default: int8 weights and activations) "
                                                    "or w4a16 (int4 weights)")
    p.add_argument("--calibrate", type=int, default=0, metavar="N",
                   help="int8: N examples for static activation scales (default 0: dynamic per-token scales); "
                        "their text comes from --calibration-data, else --recipe, else the tokenizer's vocabulary")
    p.add_argument("--calibration-data", default=None, metavar="PATH",
                   help="--calibrate: a text file (one example a line) or a .jsonl file (each record's \"text\")")
    p.add_argument("--recipe", default=None, metavar="RECIPE.yaml",
                   help="--calibrate: a recipe of yours whose validation data (else training data) are the examples; "
                        "--to hf-trainer: the recipe that trained the checkpoint (never the copy a checkpoint holds), "
                        "--section.key value overrides of it may follow")
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
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and (args.to != "hf-trainer" or not rest[0].startswith("--") or rest[0] == "--"):
        parser.parse_args(argv)  # argparse's own error for what is no argument of export
    args.overrides = rest  # --to hf-trainer: --section.key value overrides of --recipe, checked by the loader
    try:
        return _export(args)
    except OSError as exc:  # a file that cannot be read or written, where no reader named it already
        raise CheckpointError(f"export: {exc.strerror or exc}" + (f" ({exc.filename})" if exc.filename else "")) from None


def _export(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    src = Path(args.src)
    if args.to == "hf-trainer":
        from automodel_ckpt.cli.export_hf_trainer import export

        return export(src, Path(args.out) if args.out else None, Path(args.recipe) if args.recipe else None,
                      args.overrides)
    if args.calibrate and args.to != "int8":
        raise UsageError("--calibrate applies to --to int8 only")
    if args.calibrate < 0:
        raise UsageError(f"--calibrate: expected a number of examples >= 0, got {args.calibrate}")
    if (args.calibration_data or args.recipe) and not args.calibrate:
        raise UsageError("--calibration-data and --recipe name the examples of --calibrate N; give --calibrate too")
    if args.calibration_data and args.recipe:
        raise UsageError("--calibration-data and --recipe both name calibration examples; give one of them")
    from automodel_ckpt.export import export_lineage, lineage_json, open_model, write_lineage_file

    where = src.absolute()  # beside SRC as named (a link stays a link)
    stem = where.name.removesuffix(LAYOUT.ARCHIVE_SUFFIX)
    if args.adapter:
        if args.to != "gguf" or args.dry_run:
            raise UsageError("--adapter applies to --to gguf (without --dry-run)")
        from automodel_ckpt.export import write_gguf_adapter

        out = Path(args.out) if args.out else where.parent / f"{stem}-lora-{args.type}{LAYOUT.GGUF_SUFFIX}"
        done = write_gguf_adapter(src, out, args.type)
        print(f"GGUF LoRA adapter written to {out} ({human_size(done['bytes'])}, {done['factors']} factors, rank "
              f"{done['rank']}, alpha {done['alpha']:g}; apply it to the GGUF of {done['base']})", flush=True)
        return 0
    if args.to == "gguf":
        from automodel_ckpt.export import plan_gguf, write_gguf

        out = Path(args.out) if args.out else where.parent / f"{stem}-{args.type}{LAYOUT.GGUF_SUFFIX}"
        with open_model(src) as source:
            plan = plan_gguf(source, args.type)
            print(plan.describe(source), flush=True)
            if args.dry_run:
                print(f"would write {out}", flush=True)
                return 0
            done = write_gguf(source, plan, out, progress=not args.no_progress, num_threads=max(1, args.num_threads),
                              lineage=lineage_json(export_lineage([src])))
        print(f"GGUF written to {out} ({human_size(done['bytes'])}, {done['tokenizer']} tokenizer, "
              f"{done['seconds']:.2f} s)", flush=True)
        return 0
    from automodel_ckpt.export import plan_int8, write_int8

    out = Path(args.out) if args.out else where.parent / f"{stem}-{LAYOUT.INT8_EXPORT_DIR}-{args.scheme}"
    with open_model(src) as source:
        examples, origin = _calibration_examples(args, source.side_dir) if args.calibrate else (None, "")
        plan = plan_int8(source, args.scheme, examples, origin)
        print(plan.describe(source), flush=True)
        if args.dry_run:
            print(f"would write {out}", flush=True)
            return 0
        done = write_int8(source, plan, out, progress=not args.no_progress)
    write_lineage_file(out, export_lineage([src]))
    print(f"int8 model written to {out} ({human_size(done['bytes'])}, {done['seconds']:.2f} s)", flush=True)
    return 0


def _calibration_examples(args: argparse.Namespace, tokenizer_dir: Path) -> tuple[list[list[int]], str]:
    """The token ids of ``--calibrate N`` examples, and where they come from, in words. Only what the user names is
    read as data or run as a recipe: ``--calibration-data`` (a file of text), ``--recipe`` (the user's own recipe: its
    validation data, else its training data, tokenized as for training), else the tokenizer's own vocabulary. A
    checkpoint's, export's or archive's ``config.yaml`` is never read as a recipe: a ``_target_`` in it would run."""
    from transformers import AutoTokenizer

    try:  # the source's files, checked and copied privately; trust_remote_code stays off
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"--calibrate: the model's tokenizer cannot be loaded: {first_line(exc)}") from None
    n = args.calibrate
    if args.calibration_data:
        return calibration_file_examples(Path(args.calibration_data), n, tokenizer), f"'{args.calibration_data}'"
    if args.recipe:
        from automodel_ckpt.config.loader import load_config
        from automodel_ckpt.config.schema import RecipeConfig
        from automodel_ckpt.data import prepare_data

        prepared = prepare_data(load_config(args.recipe, [], RecipeConfig), tokenizer)
        rows = prepared.validation if prepared.validation is not None and len(prepared.validation) else prepared.train
        batch = rows.batch(list(range(min(n, len(rows)))))
        lengths = batch["attention_mask"].sum(dim=1).tolist()
        return [ids[:length].tolist() for ids, length in zip(batch["input_ids"], lengths)], \
            f"the data of the recipe '{args.recipe}'"
    return vocabulary_examples(tokenizer, n), "the tokenizer's own vocabulary (--calibration-data FILE: your text)"


def calibration_file_examples(path: Path, n: int, tokenizer: object) -> list[list[int]]:
    """The first ``n`` non-empty examples of a text file (one a line) or a ``.jsonl`` file (each record's
    ``"text"``), tokenized and cut at ``_MAX_EXAMPLE_TOKENS``; read a line at a time, each at most
    ``bounded.LOG_LINE_LIMIT`` bytes (a longer one is refused in one line naming it)."""
    import json

    try:
        f = os.fdopen(open_regular(path, follow=True), "rb")
    except OSError as exc:
        raise UsageError(f"--calibration-data '{path}' cannot be read: {exc.strerror or exc}") from None
    examples: list[list[int]] = []
    with f:
        for number, line in enumerate(iter(lambda: f.readline(LOG_LINE_LIMIT + 1), b""), start=1):
            if len(examples) >= n:
                break
            if len(line) > LOG_LINE_LIMIT:
                raise UsageError(f"--calibration-data '{path}': line {number} is longer than "
                                 f"{human_size(LOG_LINE_LIMIT)}")
            text = line.decode("utf-8", "replace").strip()
            if text and path.suffix == ".jsonl":
                try:
                    record = json.loads(text)
                except (ValueError, RecursionError):
                    raise UsageError(f"--calibration-data '{path}': line {number} is not JSON") from None
                text = record.get("text") if isinstance(record, dict) else None
                if not isinstance(text, str):
                    raise UsageError(f"--calibration-data '{path}': line {number} has no \"text\" string")
            if text:
                ids = tokenizer(text, add_special_tokens=True)["input_ids"][:_MAX_EXAMPLE_TOKENS]  # type: ignore
                if ids:
                    examples.append(list(ids))
    if not examples:
        raise UsageError(f"--calibration-data '{path}' holds no text to calibrate with")
    return examples


def vocabulary_examples(tokenizer: object, n: int, length: int = 64) -> list[list[int]]:
    """``n`` examples of ``length`` token ids each: the tokenizer's ordinary tokens (its special ones left out) in
    id order, one after another, from the start again when they run out."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids = sorted(i for i in tokenizer.get_vocab().values() if i not in special)  # type: ignore[attr-defined]
    if not ids:
        raise UsageError("--calibrate: the tokenizer has no ordinary tokens; give --calibration-data FILE")
    return [[ids[(k * length + j) % len(ids)] for j in range(length)] for k in range(n)]


_MAX_EXAMPLE_TOKENS = 2048
