"""`ckpt-train preview RECIPE.yaml [overrides]`: the first rows as the model sees them, loss spans marked, counts.

No GPU, processes or model: the recipe's data tokenized (through the cache) and rendered by ``data.preview``.
"""

from __future__ import annotations

import argparse
from typing import Any

from automodel_ckpt.cli.common import VerbParser, check_recipe, load_recipe
from automodel_ckpt.shown import allow_colors


def build_parser() -> VerbParser:
    p = VerbParser("preview", "The first rows of a recipe's data as the model sees them, loss spans marked, and counts.")
    p.add_argument("recipe", help="the recipe YAML; --section.key value overrides may follow")
    p.add_argument("--num", "-n", type=int, default=3, help="rows to show (default 3)")
    p.add_argument("--split", choices=("train", "validation"), default="train", help="which split (default train)")
    p.add_argument("--color", action="store_true", help="mark trained text in green instead of with « »")
    p.add_argument("--ids", action="store_true", help="streamed corpus: print only the sequence ids a rank trains on, "
                   "one per line (--rank R of --world-size N data-parallel ranks; reads only what that rank reads)")
    p.add_argument("--rank", type=int, default=0, help="with --ids: the data-parallel rank (default 0)")
    p.add_argument("--world-size", type=int, default=1, help="with --ids: the data-parallel size (default 1)")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The verb's own flags; every ``--section.key value`` after them is a recipe override (``args.overrides``)."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    strays = [a for a in rest if a.startswith("-") and "." not in a.split("=", 1)[0]]
    if strays:
        parser.error(f"unrecognized arguments: {' '.join(strays)}")
    args.overrides = rest
    return args


def smallest_world_size(distributed: Any) -> int:
    """The fewest processes the ``distributed:`` sizes run on (the rows are the same on any number); a size that is
    not a positive integer counts 1, for the check to refuse."""
    def size(key: str, default: int) -> int:
        value = distributed.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else default

    return size("tp_size", 1) * size("dp_size", size("dp_replicate_size", 1))


def main(argv: list[str]) -> int:
    """Print the preview; what training refuses only for what the model would see (no token with a loss) is a
    ``warning:`` line here."""
    from automodel_ckpt.config.sections import present
    from automodel_ckpt.data import is_streamed, prepare_to_show, preview_rows
    from automodel_ckpt.models.build import build_tokenizer, ensure_embedded_base, local_model_path

    args = parse_args(argv)
    allow_colors(args.color)  # our own green marks pass; a control character in the data is still escaped
    cfg = load_recipe(args.recipe, args.overrides)
    check_recipe(cfg, smallest_world_size(cfg.distributed))
    model_path = cfg.model.get("pretrained_model_name_or_path")
    if cfg.model.get("embedded") and model_path and local_model_path(model_path) is None:
        ensure_embedded_base(cfg.model.embedded, model_path)
    tokenizer = build_tokenizer(cfg.tokenizer.pretrained_model_name_or_path or model_path)
    if args.ids:
        if not is_streamed(cfg.dataset):
            from automodel_ckpt.errors import ConfigError

            raise ConfigError("preview --ids: the recipe's dataset is not streamed")
        from automodel_ckpt.data import first_ids

        for i in first_ids(cfg, tokenizer, rank=args.rank, world_size=args.world_size, num=args.num):
            print(i)
        return 0
    if is_streamed(cfg.dataset):  # the first packed sequences of the stream, in the run's order
        from automodel_ckpt.data import preview_stream

        preview_stream(cfg, tokenizer, num=args.num, split=args.split)
        return 0
    for section in present(cfg):  # an algorithm that shows its own rows (each pair's two sides)
        if section.preview is not None:
            section.preview(cfg, tokenizer, num=args.num, split=args.split, color=args.color)
            return 0
    preview_rows(prepare_to_show(cfg, tokenizer), tokenizer, num=args.num, split=args.split, color=args.color)
    return 0
