"""The preview of a recipe's data: the first rows as the model sees them, loss spans marked, and the counts."""

from __future__ import annotations

import sys
from typing import Any, TextIO

from automodel_ckpt.data.pipeline import NoLossError, PreparedData, prepare_data
from automodel_ckpt.data.tokenize import IGNORE_INDEX, TokenizedData
from automodel_ckpt.errors import ConfigError, warn


#: Plain-text marks around trained (loss) text; masked text is left bare.
OPEN, CLOSE = "«", "»"
#: Where an example is cut short: the tokens after it never reach the model.
CUT = "✂"
_GREEN, _RESET = "\033[32m", "\033[0m"


def prepare_to_show(cfg: Any, tokenizer: Any) -> PreparedData:
    """``prepare_data``, its warning shown (a ``seq_length`` training refuses too: the rows show why)."""
    try:
        prepared = prepare_data(cfg, tokenizer)
    except NoLossError as exc:
        prepared = exc.prepared
        prepared.warning = str(exc)
    if prepared.warning:
        warn(prepared.warning)
    return prepared


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
    cut = bool(data.rows[row]["num_truncated"])  # a cut example fills its row alone: the cut is at the row's end
    head = (f"── row {row} · sample {int(data.sample_ids[row])} · {len(starts)} example(s) · "
            f"{length}/{b['input_ids'].shape[1]} tokens · {n_trained} with loss{f' · cut short {CUT}' if cut else ''}")
    lines = [head]
    for k, s in enumerate(starts):
        e = starts[k + 1] if k + 1 < len(starts) else length
        text = "".join((f"{_GREEN}{piece}{_RESET}" if color else f"{OPEN}{piece}{CLOSE}") if on else piece
                       for piece, on in _segments(tokenizer, ids[s:e], trained[s:e]))
        if cut and k == len(starts) - 1:
            text += CUT
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


def _shown(prepared: Any, split: str, color: bool, what: str, out: TextIO | None) -> tuple[TextIO, Any, str]:
    """The stream to print to (the one of the moment, not of import time), the split's data, how marks look."""
    data = prepared.train if split == "train" else prepared.validation
    if data is None:
        raise ConfigError(f"preview: this recipe has no validation {what} (data.val_size is 0 and no "
                          "validation_dataset)")
    return out or sys.stdout, data, "green" if color else f"{OPEN}marked{CLOSE}"


def preview_pairs(prepared: Any, tokenizer: Any, *, num: int = 3, split: str = "train", color: bool = False,
                  out: TextIO | None = None) -> None:
    """Preference pairs (``data.pairs.PreparedPairs``): each pair's chosen and rejected rows, scored text marked."""
    out, data, marks = _shown(prepared, split, color, "pairs", out)
    print(f"First {min(num, len(data))} of {len(data)} {split} pairs; the scored text (the response whose "
          f"log-probs the loss compares) is {marks}, the prompt is context only:", file=out)
    for row in range(min(num, len(data))):
        print(f"══ pair {row} · record {int(data.record_ids[row])}", file=out)
        for side in ("chosen", "rejected"):
            print(f"{side}: " + render_row(tokenizer, getattr(data, side), row, color), file=out)
    print(prepared.report(), file=out)


def preview_rows(prepared: PreparedData, tokenizer: Any, *, num: int = 3, split: str = "train", color: bool = False,
            out: TextIO | None = None) -> None:
    out, data, marks = _shown(prepared, split, color, "data", out)
    print(f"First {min(num, len(data))} of {len(data)} {split} sequences; text with loss is {marks}, the rest is "
          "masked:", file=out)
    for row in range(min(num, len(data))):
        print(render_row(tokenizer, data, row, color), file=out)
    print(render_counts(prepared), file=out)
    print(prepared.report().split("; ")[-1], file=out)
