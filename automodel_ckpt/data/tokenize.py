"""Turns examples into fixed-length token sequences with loss masks (padding or packing)."""

from __future__ import annotations

from dataclasses import dataclass

import datasets
import torch

from automodel_ckpt.errors import ConfigError

IGNORE_INDEX = -100


@dataclass
class TokenizedData:
    """Rows of ``seq_length`` tokens. ``labels`` is IGNORE_INDEX where no loss is taken (prompt, padding).

    ``sample_ids`` maps each row to the example it came from (the first one for packed rows).
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor
    sample_ids: torch.Tensor

    def __len__(self) -> int:
        return self.input_ids.shape[0]


def _example_tokens(tokenizer, example: dict, fields: dict[str, str]) -> tuple[list[int], list[int]]:
    """(ids, labels) of one example: bos + prompt + completion + eos; loss on completion + eos only."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if fields["prompt"] in example and fields["completion"] in example:
        prompt = tokenizer(example[fields["prompt"]], add_special_tokens=False)["input_ids"]
        completion = tokenizer(example[fields["completion"]], add_special_tokens=False)["input_ids"] + eos
        ids = bos + prompt + completion
        return ids, [IGNORE_INDEX] * (len(bos) + len(prompt)) + completion
    if fields["text"] in example:
        ids = bos + tokenizer(example[fields["text"]], add_special_tokens=False)["input_ids"] + eos
        return ids, list(ids)
    raise ConfigError(
        f"dataset: examples need '{fields['prompt']}'+'{fields['completion']}' or '{fields['text']}' columns, "
        f"got {sorted(example)} (set data.prompt_field / data.completion_field / data.text_field)"
    )


def tokenize_dataset(
    ds: datasets.Dataset, tokenizer, *, seq_length: int, packing: bool, fields: dict[str, str]
) -> TokenizedData:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    ids_rows: list[list[int]] = []
    label_rows: list[list[int]] = []
    row_ids: list[int] = []
    buf_ids: list[int] = []
    buf_labels: list[int] = []
    buf_first = -1
    for i, example in enumerate(ds):
        sid = int(example.get("id", i))
        ids, labels = _example_tokens(tokenizer, example, fields)
        if not packing:
            ids_rows.append(ids[:seq_length])
            label_rows.append(labels[:seq_length])
            row_ids.append(sid)
            continue
        if buf_first < 0:
            buf_first = sid
        buf_ids += ids
        buf_labels += labels
        while len(buf_ids) >= seq_length:
            ids_rows.append(buf_ids[:seq_length])
            label_rows.append(buf_labels[:seq_length])
            row_ids.append(buf_first)
            buf_ids, buf_labels, buf_first = buf_ids[seq_length:], buf_labels[seq_length:], sid
    n = len(ids_rows)
    input_ids = torch.full((n, seq_length), pad, dtype=torch.long)
    labels_t = torch.full((n, seq_length), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((n, seq_length), dtype=torch.long)
    for r, (ids, labels) in enumerate(zip(ids_rows, label_rows)):
        input_ids[r, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        labels_t[r, : len(labels)] = torch.tensor(labels, dtype=torch.long)
        mask[r, : len(ids)] = 1
    return TokenizedData(input_ids, labels_t, mask, torch.tensor(row_ids, dtype=torch.long))
