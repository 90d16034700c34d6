"""`ckpt-train preview RECIPE.yaml [overrides]`: the first rows as the model sees them, loss spans marked, counts.

Runs without a GPU, processes or a model: it loads the recipe, tokenizes its data (through the cache) and prints
``data.preview``'s rendering.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from automodel_ckpt.errors import ConfigError

USAGE = "usage: ckpt-train preview RECIPE.yaml [--num N] [--split train|validation] [--color] [--section.key value ...]"


@dataclass
class PreviewArgs:
    recipe: str
    num: int = 3
    split: str = "train"
    color: bool = False
    overrides: list[str] = field(default_factory=list)


def parse_args(argv: list[str]) -> PreviewArgs:
    """The verb's own flags; every other ``--section.key value`` is a recipe override."""
    if not argv or argv[0].startswith("-"):
        raise ConfigError(f"preview: name a recipe first ({USAGE})")
    args = PreviewArgs(argv[0])
    rest = argv[1:]
    i = 0
    while i < len(rest):
        arg = rest[i]
        name, eq, value = arg.partition("=")
        if name in ("--num", "-n", "--split"):
            if not eq:
                if i + 1 >= len(rest):
                    raise ConfigError(f"preview: {name} needs a value ({USAGE})")
                value, i = rest[i + 1], i + 1
            if name == "--split":
                if value not in ("train", "validation"):
                    raise ConfigError(f"preview: --split is train or validation, got '{value}'")
                args.split = value
            else:
                try:
                    args.num = int(value)
                except ValueError:
                    raise ConfigError(f"preview: --num expects a number, got '{value}'") from None
        elif arg == "--color":
            args.color = True
        elif arg != "--debug":
            args.overrides.append(arg)
        i += 1
    return args


def main(argv: list[str]) -> int:
    """Load the recipe, tokenize its data (through the cache) and print the preview; no model, no processes."""
    from automodel_ckpt.config.loader import load_config
    from automodel_ckpt.config.schema import RecipeConfig
    from automodel_ckpt.config.validate import check_inputs_exist, validate_config
    from automodel_ckpt.data.pipeline import prepare_data
    from automodel_ckpt.data.preview import preview
    from automodel_ckpt.models.build import build_tokenizer, ensure_embedded_base, local_model_path

    args = parse_args(argv)
    cfg = load_config(args.recipe, args.overrides, RecipeConfig)
    validate_config(cfg, 1)
    check_inputs_exist(cfg)
    model_path = cfg.model.get("pretrained_model_name_or_path")
    if cfg.model.get("embedded") and model_path and local_model_path(model_path) is None:
        ensure_embedded_base(cfg.model.embedded, model_path)
    tokenizer = build_tokenizer(cfg.tokenizer.pretrained_model_name_or_path or model_path)
    preview(prepare_data(cfg, tokenizer), tokenizer, num=args.num, split=args.split, color=args.color)
    return 0
