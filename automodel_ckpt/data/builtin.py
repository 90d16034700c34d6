"""Built-in offline task: two-digit addition, with a train/held-out split that is disjoint by construction."""

from __future__ import annotations

import hashlib
import random
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where rows are made: checking a recipe's dataset section needs none of it
    import datasets

#: Two-digit operands, inclusive: the fixed shape ``"ab+cd="`` puts every digit in one place, learned faster.
MIN_OPERAND: int = 10
MAX_OPERAND: int = 99

#: A problem is held out when its hash lands in the first ``HELDOUT_BUCKETS`` of 100 (about 800 problems).
HELDOUT_BUCKETS: int = 10

_SPLITS = ("train", "heldout")


def is_heldout(a: int, b: int) -> bool:
    """Whether ``a + b`` is held out, by a stable hash of the problem: no seed or sample count moves it to training."""
    digest = hashlib.sha256(f"{a}+{b}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % 100 < HELDOUT_BUCKETS


@lru_cache(maxsize=None)
def addition_problems(split: str) -> tuple[tuple[int, int], ...]:
    """All ``(a, b)`` operand pairs of one split, in a fixed order."""
    if split not in _SPLITS:
        raise ValueError(f"split must be one of {_SPLITS}, got {split!r}")
    want_heldout = split == "heldout"
    operands = range(MIN_OPERAND, MAX_OPERAND + 1)
    return tuple((a, b) for a in operands for b in operands if is_heldout(a, b) == want_heldout)


def _prompt(a: int, b: int) -> str:
    return f"{a}+{b}="


def arithmetic_dataset(num_samples: int = 20000, seed: int = 1234, split: str = "train") -> datasets.Dataset:
    """Addition problems ``"37+45="`` -> ``"82"`` drawn with replacement from one split, the same for one seed."""
    from automodel_ckpt.data.generated import kept_on_disk

    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples}")
    arguments = {"num_samples": num_samples, "seed": seed, "split": split}
    return kept_on_disk("arithmetic", arguments, lambda: _arithmetic_rows(num_samples, seed, split))


def _arithmetic_rows(num_samples: int, seed: int, split: str) -> datasets.Dataset:
    import datasets

    pool = addition_problems(split)
    rng = random.Random(f"{split}:{seed}")
    drawn = [pool[rng.randrange(len(pool))] for _ in range(num_samples)]
    return datasets.Dataset.from_dict(
        {"id": list(range(num_samples)), "prompt": [_prompt(a, b) for a, b in drawn],
         "completion": [str(a + b) for a, b in drawn]},
        features=datasets.Features({"id": datasets.Value("int64"), "prompt": datasets.Value("string"),
                                    "completion": datasets.Value("string")}))


#: Task-neutral name of the built-in dataset factory (same signature as :func:`arithmetic_dataset`).
builtin_task_dataset = arithmetic_dataset


def chat_task_dataset(num_samples: int = 20000, seed: int = 1234, split: str = "train",
                      system: str | None = None) -> datasets.Dataset:
    """The problems of :func:`arithmetic_dataset` as chats: [system?], user ``"37+45="``, assistant ``"82"``."""
    from automodel_ckpt.data.generated import kept_on_disk

    arguments = {"num_samples": num_samples, "seed": seed, "split": split, "system": system}
    return kept_on_disk("arithmetic_chats", arguments, lambda: _chat_rows(num_samples, seed, split, system))


def _chat_rows(num_samples: int, seed: int, split: str, system: str | None) -> datasets.Dataset:
    import datasets

    rows = arithmetic_dataset(num_samples, seed, split)
    head = [{"role": "system", "content": system}] if system else []
    return datasets.Dataset.from_dict({
        "id": rows["id"],
        "messages": [head + [{"role": "user", "content": p}, {"role": "assistant", "content": c}]
                     for p, c in zip(rows["prompt"], rows["completion"])],
    })


def near_miss(a: int, b: int, rng: random.Random) -> int:
    """A wrong sum that looks right: the right one off by one or by ten (never negative)."""
    return a + b + rng.choice((-10, -1, 1, 10))


def preference_task_dataset(num_samples: int = 20000, seed: int = 1234, split: str = "train") -> datasets.Dataset:
    """The problems of :func:`arithmetic_dataset` as pairs: ``chosen`` ``"82"``, ``rejected`` a near miss (``"81"``)."""
    from automodel_ckpt.data.generated import kept_on_disk

    arguments = {"num_samples": num_samples, "seed": seed, "split": split}
    return kept_on_disk("arithmetic_pairs", arguments, lambda: _pair_rows(num_samples, seed, split))


def _pair_rows(num_samples: int, seed: int, split: str) -> datasets.Dataset:
    import datasets

    rows = arithmetic_dataset(num_samples, seed, split)
    rng = random.Random(f"near-miss:{split}:{seed}")
    rejected = []
    for prompt in rows["prompt"]:
        a, b = (int(x) for x in prompt.rstrip("=").split("+"))
        rejected.append(str(near_miss(a, b, rng)))
    return datasets.Dataset.from_dict({"id": rows["id"], "prompt": rows["prompt"], "chosen": rows["completion"],
                                       "rejected": rejected})


def heldout_examples(n: int = 200, seed: int = 4321) -> list[tuple[str, str]]:
    """``n`` (at most all) distinct ``(prompt, answer)`` pairs of the held-out partition."""
    pool = addition_problems("heldout")
    rng = random.Random(f"heldout-examples:{seed}")
    chosen = rng.sample(pool, k=min(n, len(pool)))
    return [(_prompt(a, b), str(a + b)) for a, b in chosen]
