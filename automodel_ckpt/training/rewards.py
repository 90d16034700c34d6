"""Reward functions for online RL (named in a recipe's ``grpo.reward_funcs``) and the check of what they return."""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from automodel_ckpt.errors import UserError


class RewardError(UserError):
    """A reward function failed or returned something that is not one finite number per completion."""


def exact_answer(prompts: Sequence[str], completions: Sequence[str], answers: Sequence[str], **_: Any) -> list[float]:
    """1.0 where the completion (its end-of-sequence left out, spaces stripped) is the answer, else 0.0."""
    return [1.0 if c.strip() == str(a).strip() else 0.0 for c, a in zip(completions, answers)]


def answer_digits(prompts: Sequence[str], completions: Sequence[str], answers: Sequence[str], **_: Any
                  ) -> list[float]:
    """Partial credit: the share of the answer's characters the completion has at the same place (left-aligned,
    over the longer of the two); 1.0 only for the exact answer."""
    out = []
    for c, a in zip(completions, answers):
        c, a = c.strip(), str(a).strip()
        out.append(sum(x == y for x, y in zip(c, a)) / max(len(c), len(a), 1))
    return out


def digits_then_eos(prompts: Sequence[str], completions: Sequence[str], answers: Sequence[str], *,
                    ended: Sequence[bool], **_: Any) -> list[float]:
    """1.0 where the completion is one or more digits and then the end of sequence, else 0.0."""
    return [1.0 if e and c.isdigit() else 0.0 for c, e in zip(completions, ended)]


def score(name: str, fn: Callable[..., Any], prompts: Sequence[str], completions: Sequence[str],
          answers: Sequence[str], ended: Sequence[bool]) -> list[float]:
    """``fn``'s rewards, checked: one finite number per completion, else one line naming the function."""
    try:
        values = fn(list(prompts), list(completions), list(answers), ended=list(ended))
    except Exception as exc:  # the user's code: its failure in one line with its name
        raise RewardError(f"reward function {name} failed: {type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")) from exc
    try:
        values = [float(v) for v in values]
    except (TypeError, ValueError) as exc:
        raise RewardError(f"reward function {name} returned {type(values).__name__}, not one number per "
                          "completion") from exc
    if len(values) != len(completions):
        raise RewardError(f"reward function {name} returned {len(values)} rewards for {len(completions)} "
                          "completions")
    bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
    if bad:
        raise RewardError(f"reward function {name} returned {values[bad[0]]} for completion {bad[0]} "
                          f"({len(bad)} not finite)")
    return values
