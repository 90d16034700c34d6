"""`ckpt-train preview`: the first rows as the model sees them, loss spans marked, and the data's counts."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, TextIO

from automodel_ckpt.data.pipeline import PreparedData
from automodel_ckpt.data.tokenize import IGNORE_INDEX, TokenizedData
from automodel_ckpt.errors import ConfigError

USAGE = "usage: ckpt-train preview RECIPE.yaml [--num N] [--split train|validation] [--color] [--section.key value ...]"

#: Plain-text marks around trained (loss) text; masked text is left bare.
OPEN, CLOSE = "«", "»"
_GREEN, _RESET = "\033[32m", "\033[0m"


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


def _segments(tokenizer: Any, ids: list[int], trained: list[bool]) -> list[tuple[str, bool]]:
    """Decoded runs of tokens that share one state (trained or masked)."""
    out: list[tuple[str, bool]] = []
    start = 0
    for t in range(1, len(ids) + 1):
        if t == len(ids) or trained[t] != trained[start]:
            out.append((tokenizer.decode(ids[start:t], skip_special_tokens=False), trained[start]))
            start = t
    return out


def render_row(tokenizer: Any, data: TokenizedData, row: int, color: bool = False) -> str:
    """One row: a header line, then each example in it with its trained text marked."""
    b = data.batch([row])
    length = int(b["attention_mask"][0].sum())
    ids = b["input_ids"][0, :length].tolist()
    labels = b["labels"][0, :length].tolist()
    starts = [0]
    if b["position_ids"] is not None:
        starts = [t for t, p in enumerate(b["position_ids"][0, :length].tolist()) if p == 0] or [0]
    trained = [label != IGNORE_INDEX for label in labels]
    n_trained = sum(trained[1:])
    head = (f"── row {row} · sample {int(data.sample_ids[row])} · {len(starts)} example(s) · "
            f"{length}/{b['input_ids'].shape[1]} tokens · {n_trained} with loss")
    lines = [head]
    for k, s in enumerate(starts):
        e = starts[k + 1] if k + 1 < len(starts) else length
        text = "".join(
            (f"{_GREEN}{piece}{_RESET}" if color else f"{OPEN}{piece}{CLOSE}") if on else piece
            for piece, on in _segments(tokenizer, ids[s:e], trained[s:e])
        )
        lines.append(("  + " if k else "    ") + text.replace("\n", "\n    "))
    return "\n".join(lines)


def render_counts(prepared: PreparedData) -> str:
    lines = []
    for name, data in (("train", prepared.train), ("validation", prepared.validation)):
        if data is None:
            continue
        t = data.totals()
        eff = t["tokens"] / max(t["rows"] * prepared.spec.seq_length, 1)
        lines.append(f"{name}: {t['examples']} examples, {t['rows']} sequences of {prepared.spec.seq_length} tokens, "
                     f"{t['tokens']} tokens ({t['trained_tokens']} with loss), {t['truncated']} truncated examples, "
                     f"{'packing' if prepared.spec.packing else 'padding'} efficiency {100 * eff:.1f}%")
    return "\n".join(lines)


def preview(prepared: PreparedData, tokenizer: Any, *, num: int = 3, split: str = "train", color: bool = False,
            out: TextIO = sys.stdout) -> None:
    data = prepared.train if split == "train" else prepared.validation
    if data is None:
        raise ConfigError("preview: this recipe has no validation data (data.val_size is 0 and no validation_dataset)")
    marks = "green" if color else f"{OPEN}marked{CLOSE}"
    print(f"First {min(num, len(data))} of {len(data)} {split} sequences; text with loss is {marks}, the rest is "
          "masked:", file=out)
    for row in range(min(num, len(data))):
        print(render_row(tokenizer, data, row, color), file=out)
    print(render_counts(prepared), file=out)
    print(prepared.report().split("; ")[-1], file=out)


def main(argv: list[str]) -> int:
    """Load the recipe, tokenize its data (through the cache) and print the preview; no model, no processes."""
    from automodel_ckpt.config.loader import load_config
    from automodel_ckpt.config.schema import RecipeConfig
    from automodel_ckpt.config.validate import check_inputs_exist, validate_config
    from automodel_ckpt.data.pipeline import prepare_data
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
