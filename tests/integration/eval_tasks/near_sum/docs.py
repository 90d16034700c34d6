"""The ``near_sum`` task's documents: the ``addition`` task's held-out sums, each with a near miss of its answer."""

from __future__ import annotations

import json
from typing import Any


def docs(**_: Any) -> Any:
    import datasets

    from automodel_ckpt.evaluation.tasks.addition.problems import PROBLEMS_FILE

    rows = [json.loads(line) for line in PROBLEMS_FILE.read_text(encoding="utf-8").splitlines() if line]
    rows = [{**row, "near": row["answer"][:-1] + str((int(row["answer"][-1]) + 1) % 10)} for row in rows]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
