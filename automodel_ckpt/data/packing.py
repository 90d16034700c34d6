"""Fixed-length rows from tokenized examples: one padded example per row, or several packed into one."""

from __future__ import annotations

import numpy as np

from automodel_ckpt.data.encode import IGNORE_INDEX
from automodel_ckpt.sizes import in_groups


class RowBuilder:
    """``builder(batch)`` -> rows of ``seq_length`` tokens, for a batched ``datasets.map``: one example per row,
    right-padded, or examples packed whole in order. A packed row's ``position_ids`` restart at every example, whose
    first token takes no loss; ``sample_id`` is the row's first example."""

    def __init__(self, seq_length: int, packing: bool, pad_id: int) -> None:
        self.n = seq_length
        self.packing = packing
        self.pad_id = pad_id

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        lengths = [len(x) for x in batch["input_ids"]]
        singles = [[k] for k in range(len(lengths))]
        groups = in_groups(range(len(lengths)), lambda k: lengths[k], self.n) if self.packing else singles
        rows = len(groups)
        ids = np.full((rows, self.n), self.pad_id, dtype=np.int32)
        labels = np.full((rows, self.n), IGNORE_INDEX, dtype=np.int32)
        positions = np.zeros((rows, self.n), dtype=np.int32)
        lengths, sample_ids, docs, truncated, trained = [], [], [], [], []
        for r, group in enumerate(groups):
            pos = 0
            for k in group:
                x, y = batch["input_ids"][k], batch["labels"][k]
                ids[r, pos:pos + len(x)] = x
                labels[r, pos:pos + len(y)] = y
                positions[r, pos:pos + len(x)] = np.arange(len(x))
                if self.packing:
                    labels[r, pos] = IGNORE_INDEX
                pos += len(x)
            positions[r, pos:] = np.arange(self.n - pos)
            lengths.append(pos)
            sample_ids.append(batch["sample_id"][group[0]])
            docs.append(len(group))
            truncated.append(sum(batch["num_tokens"][k] > self.n for k in group))
            trained.append(int((labels[r, 1:] != IGNORE_INDEX).sum()))
        out = {"input_ids": list(ids), "labels": list(labels), "length": lengths, "sample_id": sample_ids,
               "num_examples": docs, "num_truncated": truncated, "num_trained": trained}
        if self.packing:
            out["position_ids"] = list(positions)
        if "pixel_values" in batch:  # image examples are never packed: row r is example r
            out["pixel_values"] = batch["pixel_values"]
        return out
