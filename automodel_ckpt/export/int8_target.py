"""``--to int8``: a compressed-tensors int8 folder for vLLM, with static activation scales from examples the user names.

``--calibrate N`` takes its examples only from what the user names: ``--calibration-data`` (a text file),
``--recipe`` (its data, which only the CLI may build), else the tokenizer's own vocabulary. A checkpoint's, export's
or archive's ``config.yaml`` is never read as a recipe: a ``_target_`` in it would run.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from automodel_ckpt.errors import CheckpointError, UsageError, first_line
from automodel_ckpt.export.target import ExportRequest, ExportTarget
from automodel_ckpt.ondisk import LOG_LINE_LIMIT, ModelFolder, open_regular
from automodel_ckpt.sizes import human_size

NAME = "int8"
_MAX_EXAMPLE_TOKENS = 2048
_WITHOUT_CALIBRATE = "--calibration-data and --recipe name the examples of --calibrate N; give --calibrate too"


class Int8Target(ExportTarget):
    name = NAME
    summary = "a compressed-tensors int8 folder for vLLM"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--scheme", default="w8a8", help="int8 scheme: w8a8 (default: int8 weights and "
                                                             "activations) or w4a16 (int4 weights)")
        parser.add_argument("--calibrate", type=int, default=0, metavar="N",
                            help="int8: N examples for static activation scales (default 0: dynamic per-token "
                                 "scales); their text comes from --calibration-data, else --recipe, else the "
                                 "tokenizer's vocabulary")
        parser.add_argument("--calibration-data", default=None, metavar="PATH",
                            help="--calibrate: a text file (one example a line) or a .jsonl file (each record's "
                                 "\"text\")")

    def refuse(self, args: argparse.Namespace) -> None:
        if args.calibrate:
            raise UsageError(f"--calibrate applies to --to {NAME} only")
        if args.calibration_data or args.recipe:
            raise UsageError(_WITHOUT_CALIBRATE)

    def export(self, request: ExportRequest) -> int:
        from automodel_ckpt.export.int8_export import plan_int8, write_int8
        from automodel_ckpt.export.commit import write_lineage_file
        from automodel_ckpt.export.model_source import open_model

        args, src = request.args, request.src
        if args.calibrate < 0:
            raise UsageError(f"--calibrate: expected a number of examples >= 0, got {args.calibrate}")
        if (args.calibration_data or args.recipe) and not args.calibrate:
            raise UsageError(_WITHOUT_CALIBRATE)
        if args.calibration_data and args.recipe:
            raise UsageError("--calibration-data and --recipe both name calibration examples; give one of them")
        out = request.out(f"-{ModelFolder.int8}-{args.scheme}")
        with open_model(src) as source:
            examples, origin = _examples(request, source.side_dir) if args.calibrate else (None, "")
            plan = plan_int8(source, args.scheme, examples, origin)
            print(plan.describe(source), flush=True)
            if args.dry_run:
                print(f"would write {out}", flush=True)
                return 0
            done = write_int8(source, plan, out, progress=not args.no_progress)
        if request.lineage:
            write_lineage_file(out, request.lineage())
        print(f"int8 model written to {out} ({human_size(done['bytes'])}, {done['seconds']:.2f} s)", flush=True)
        return 0


def _examples(request: ExportRequest, tokenizer_dir: Path) -> tuple[list[list[int]], str]:
    """The token ids of ``--calibrate N`` examples, and where they come from, in words."""
    from transformers import AutoTokenizer

    args = request.args
    try:  # the source's files, checked and copied privately; trust_remote_code stays off
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"--calibrate: the model's tokenizer cannot be loaded: {first_line(exc)}") from None
    n = args.calibrate
    if args.calibration_data:
        return calibration_file_examples(Path(args.calibration_data), n, tokenizer), f"'{args.calibration_data}'"
    if args.recipe:
        if request.recipe_examples is None:
            raise UsageError("--recipe: this caller cannot read a recipe's data; give --calibration-data FILE")
        return request.recipe_examples(args.recipe, tokenizer, n), f"the data of the recipe '{args.recipe}'"
    return vocabulary_examples(tokenizer, n), "the tokenizer's own vocabulary (--calibration-data FILE: your text)"


def calibration_file_examples(path: Path, n: int, tokenizer: Any) -> list[list[int]]:
    """The first ``n`` non-empty examples of a text file (one a line) or a ``.jsonl`` file (each record's
    ``"text"``), tokenized and cut at ``_MAX_EXAMPLE_TOKENS``; a line over ``LOG_LINE_LIMIT`` bytes is refused."""
    limit = LOG_LINE_LIMIT
    try:
        f = os.fdopen(open_regular(path, follow=True), "rb")
    except OSError as exc:
        raise UsageError(f"--calibration-data '{path}' cannot be read: {exc.strerror or exc}") from None
    examples: list[list[int]] = []
    with f:
        for number, line in enumerate(iter(lambda: f.readline(limit + 1), b""), start=1):
            if len(examples) >= n:
                break
            if len(line) > limit:
                raise UsageError(f"--calibration-data '{path}': line {number} is longer than {human_size(limit)}")
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
                ids = tokenizer(text, add_special_tokens=True)["input_ids"][:_MAX_EXAMPLE_TOKENS]
                if ids:
                    examples.append(list(ids))
    if not examples:
        raise UsageError(f"--calibration-data '{path}' holds no text to calibrate with")
    return examples


def vocabulary_examples(tokenizer: Any, n: int, length: int = 64) -> list[list[int]]:
    """``n`` examples of ``length`` token ids each: the tokenizer's ordinary tokens (its special ones left out) in
    id order, one after another, from the start again when they run out."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids = sorted(i for i in tokenizer.get_vocab().values() if i not in special)
    if not ids:
        raise UsageError("--calibrate: the tokenizer has no ordinary tokens; give --calibration-data FILE")
    return [[ids[(k * length + j) % len(ids)] for j in range(length)] for k in range(n)]


TARGET = Int8Target()
