"""The ``addition`` task's problems: the held-out sums of the embedded recipe, in ``examples/generate.py``'s order.

``addition.jsonl`` beside this file holds every held-out problem of ``data.builtin`` (``prompt`` ``"37+45="``,
``answer`` ``"82"``), in the order ``heldout_examples`` draws them: its first N rows are the N problems
``examples/generate.py --n N`` scores (for N >= 86, where Python's sampling keeps a prefix), so both score the same
problems. ``docs`` is the harness's ``custom_dataset``: the file is read locally, nothing is downloaded.
``python -m automodel_ckpt.evaluation.tasks.addition.problems`` writes the file again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PROBLEMS_FILE = Path(__file__).resolve().parent / "addition.jsonl"


def rows() -> list[dict[str, str]]:
    """Every held-out problem as the file holds it (generated like the recipe's data)."""
    from automodel_ckpt.data import addition_problems, heldout_examples

    return [{"prompt": p, "answer": a} for p, a in heldout_examples(len(addition_problems("heldout")))]


def docs(**_: Any) -> dict[str, Any]:
    """The task's documents: a ``test`` split read from ``addition.jsonl``."""
    import datasets

    lines = PROBLEMS_FILE.read_text(encoding="utf-8").splitlines()
    return datasets.DatasetDict({"test": datasets.Dataset.from_list([json.loads(line) for line in lines if line])})


if __name__ == "__main__":
    PROBLEMS_FILE.write_text("".join(json.dumps(r) + "\n" for r in rows()), encoding="utf-8")
