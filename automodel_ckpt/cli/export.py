"""`ckpt-train export SRC --to TARGET`: a checkpoint, an export folder or an archive in another program's format.

``--to`` names a target of ``export``'s registry. Only the CLI may build a recipe, so ``--to hf-trainer`` is
registered here, and so is ``_recipe_examples`` (a recipe's data tokenized as for training) for the targets.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from automodel_ckpt.cli.common import VerbParser
from automodel_ckpt.cli.export_hf_trainer import TARGET as HF_TRAINER
from automodel_ckpt.errors import CheckpointError
from automodel_ckpt.export import (DEFAULT_TARGET, ExportRequest, ExportTarget, export_lineage, export_targets,
                                   get_target, register_target)

register_target(HF_TRAINER)


def build_parser() -> VerbParser:
    targets = export_targets()
    p = VerbParser("export", "Write a checkpoint, an export folder or an archive in another program's format "
                             "(--to).")
    p.add_argument("src", help="a checkpoint folder (epoch_E_step_N), a Hugging Face folder or an archive (.tar)")
    p.add_argument("--to", default=DEFAULT_TARGET, choices=[t.name for t in targets],
                   help=f"what to write (default: {DEFAULT_TARGET}): "
                        + "; ".join(f"{t.name}, {t.summary}" for t in targets))
    p.add_argument("--recipe", default=None, metavar="RECIPE.yaml",
                   help="--calibrate: a recipe of yours whose validation data (else training data) are the examples; "
                        "--to hf-trainer: the recipe that trained the checkpoint (never the copy a checkpoint holds), "
                        "--section.key value overrides of it may follow")
    p.add_argument("--out", default=None, help="the file or folder to write (default: beside SRC, named after SRC "
                                               "and the target's options); replaced if it exists")
    p.add_argument("--dry-run", action="store_true", help="print the plan (family, tensors, bytes out), write nothing")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    for target in targets:
        target.add_arguments(p)
    return p


def main(argv: list[str]) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    target = get_target(args.to)
    if rest and (not target.takes_overrides or not rest[0].startswith("--") or rest[0] == "--"):
        parser.parse_args(argv)  # argparse's own error for what is no argument of export
    args.overrides = rest  # a target that takes them: --section.key value overrides of --recipe, checked by the loader
    try:
        return _export(target, args)
    except OSError as exc:  # a file that cannot be read or written, where no reader named it already
        raise CheckpointError(f"export: {exc.strerror or exc}" + (f" ({exc.filename})" if exc.filename else "")) from None


def _export(target: ExportTarget, args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if target.checks_other_options:
        for other in export_targets():
            if other is not target:
                other.refuse(args)
    return target.export(ExportRequest(args, recipe_examples=_recipe_examples,
                                       lineage=lambda: export_lineage([Path(args.src)])))


def _recipe_examples(recipe: str | Path, tokenizer: Any, n: int) -> list[list[int]]:
    """The token ids of the first ``n`` rows of the user's recipe's validation data (else its training data),
    tokenized as for training. Only a recipe the user names on the command line is built, never a checkpoint's copy."""
    from automodel_ckpt.cli.common import load_recipe
    from automodel_ckpt.data import prepare_data

    prepared = prepare_data(load_recipe(str(recipe), []), tokenizer)
    rows = prepared.validation if prepared.validation is not None and len(prepared.validation) else prepared.train
    batch = rows.batch(list(range(min(n, len(rows)))))
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    return [ids[:length].tolist() for ids, length in zip(batch["input_ids"], lengths)]
