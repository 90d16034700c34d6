"""Turns a batch of records into token ids and loss labels (one example each), as ``datasets.map`` calls it.

``RecordEncoder`` does the same for a streamed corpus, keeping a record whole (the packer carries its tail over).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bisect import bisect_left

from automodel_ckpt.data.chat import ChatRenderer
from automodel_ckpt.data.fields import RecordTemplate
from automodel_ckpt.errors import ConfigError, UserError

IGNORE_INDEX = -100
MODES = ("chat", "template", "prompt_completion", "text")


@dataclass(frozen=True)
class DataSpec:
    """Everything that decides the token sequences; all of it goes into the cache fingerprint."""

    seq_length: int
    packing: bool = False
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    text_field: str = "text"
    messages_field: str = "messages"
    image_field: str = "image"
    prompt_template: str | None = None
    completion_template: str | None = None
    chat_loss: str = "assistant"
    chat_template: str | None = None
    num_proc: int | None = None
    map_batch_size: int = 1000
    cache_dir: str | None = None

    def mode(self, columns: list[str]) -> str:
        """How records become examples, from the recipe's templates or else from the dataset's columns."""
        if self.prompt_template is not None or self.completion_template is not None:
            if self.prompt_template is None or self.completion_template is None:
                missing = "prompt_template" if self.prompt_template is None else "completion_template"
                raise ConfigError(f"data.{missing}: set both data.prompt_template and data.completion_template")
            return "template"
        if self.messages_field in columns:
            return "chat"
        if self.prompt_field in columns and self.completion_field in columns:
            return "prompt_completion"
        if self.text_field in columns:
            return "text"
        raise ConfigError(
            f"dataset: records need a '{self.messages_field}' column, '{self.prompt_field}'+"
            f"'{self.completion_field}' columns or a '{self.text_field}' column, got {sorted(columns)} "
            "(set data.messages_field / data.prompt_field / data.completion_field / data.text_field, or build them "
            "with data.prompt_template and data.completion_template)")


class Encoder:
    """``encoder(batch, indices)``: each record's ids and labels cut to ``seq_length`` (``num_tokens``: uncut)."""

    def __init__(self, tokenizer: Any, spec: DataSpec, mode: str) -> None:
        self.tokenizer = tokenizer
        self.spec = spec
        self.mode = mode
        self.bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        self.eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        self.chat = ChatRenderer(tokenizer, chat_template=spec.chat_template, loss=spec.chat_loss) \
            if mode == "chat" else None
        self.templates = (RecordTemplate(spec.prompt_template, "data.prompt_template"),
                          RecordTemplate(spec.completion_template, "data.completion_template")) \
            if mode == "template" else None

    def __call__(self, batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        ids, labels = self.encode(batch, indices)
        return token_columns(ids, labels, batch, indices, self.spec.seq_length)

    def encode(self, batch: dict[str, list], indices: list[int]) -> tuple[list[list[int]], list[list[int]]]:
        """``(input_ids, labels)`` of each record of ``batch``, whole (not cut to ``seq_length``)."""
        if self.mode == "chat":
            return self._chat(batch, indices)
        if self.mode == "text":
            return self._text(batch[self.spec.text_field])
        prompts, completions = self._prompts(batch, indices)
        return self._prompt_completion(prompts, completions)

    def _prompts(self, batch: dict[str, list], indices: list[int]) -> tuple[list[str], list[str]]:
        if self.templates is None:
            return batch[self.spec.prompt_field], batch[self.spec.completion_field]
        records = [({key: batch[key][k] for key in batch}, i) for k, i in enumerate(indices)]
        return [self.templates[0].render(*r) for r in records], [self.templates[1].render(*r) for r in records]

    def _encode(self, texts: list[str], offsets: bool = False) -> tuple[list[list[int]], list[list[tuple[int, int]]]]:
        """Token ids (and character offsets) of ``texts``, no special tokens, from a fast tokenizer's backend."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:
            encodings = backend.encode_batch(texts, add_special_tokens=False)
            return [e.ids for e in encodings], [e.offsets for e in encodings] if offsets else []
        if offsets:
            raise ConfigError("tokenizer: chat data needs a fast tokenizer (one with offset mapping)")
        return self.tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"], []

    def _prompt_completion(self, prompts: list[str], completions: list[str]) -> tuple[list[list[int]], list[list[int]]]:
        p_ids = self._encode(prompts)[0]
        c_ids = self._encode(completions)[0]
        ids, labels = [], []
        masked = len(self.bos)
        for p, c in zip(p_ids, c_ids):
            comp = c + self.eos
            ids.append(self.bos + p + comp)
            labels.append([IGNORE_INDEX] * (masked + len(p)) + comp)
        return ids, labels

    def _text(self, texts: list[str]) -> tuple[list[list[int]], list[list[int]]]:
        ids = [self.bos + x + self.eos for x in self._encode(texts)[0]]
        return ids, [list(x) for x in ids]

    def _chat(self, batch: dict[str, list], indices: list[int]) -> tuple[list[list[int]], list[list[int]]]:
        assert self.chat is not None
        rendered = [self.chat.render(messages, i, self.spec.messages_field)
                    for messages, i in zip(batch[self.spec.messages_field], indices)]
        all_ids, all_offsets = self._encode([text for text, _ in rendered], offsets=True)
        labels_out = []
        for ids, offsets, (_, trained) in zip(all_ids, all_offsets, rendered):
            starts = [o[0] for o in offsets]
            labels = [IGNORE_INDEX] * len(ids)
            for s, e in trained:  # tokens that start inside a span take the loss
                a, b = bisect_left(starts, s), bisect_left(starts, e)
                labels[a:b] = ids[a:b]
            labels_out.append(labels)
        return all_ids, labels_out


def token_columns(ids: list[list[int]], labels: list[list[int]], batch: dict, indices: list[int], n: int) -> dict:
    """The tokenized columns of a batch: ids and labels cut to n tokens, sample ids, untruncated lengths."""
    ids_col = batch.get("id")  # an integer id column names the samples; otherwise the record number does
    if ids_col is not None and not all(isinstance(x, int) and not isinstance(x, bool) for x in ids_col):
        ids_col = None
    return {"input_ids": [x[:n] for x in ids], "labels": [x[:n] for x in labels],
            "sample_id": [int(ids_col[k]) if ids_col is not None else i for k, i in enumerate(indices)],
            "num_tokens": [len(x) for x in ids]}


class BadRecord(Exception):
    """Record ``index`` of a batch cannot be encoded; ``reason`` says why in a few words."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(reason)
        self.index, self.reason = index, reason


class RecordEncoder:
    """``check(record)``: why a record cannot be encoded (``None``: it can); ``encode(records)``: ``(ids, labels)``."""

    def __init__(self, tokenizer: Any, spec: DataSpec) -> None:
        self.tokenizer, self.spec = tokenizer, spec
        self._encoders: dict[str, Encoder] = {}

    def mode(self, record: dict[str, Any]) -> str:
        return self.spec.mode(list(record))

    def check(self, record: dict[str, Any]) -> str | None:
        try:
            mode = self.mode(record)
        except UserError:
            return (f"no '{self.spec.text_field}', '{self.spec.messages_field}' or '{self.spec.prompt_field}'+"
                    f"'{self.spec.completion_field}' field (has: {', '.join(sorted(record)[:8])})")
        s = self.spec
        if mode == "text" and not isinstance(record.get(s.text_field), str):
            return f"field '{s.text_field}' is not a string"
        if mode == "chat" and not isinstance(record.get(s.messages_field), list):
            return f"field '{s.messages_field}' is not a list of messages"
        if mode == "prompt_completion" and not all(isinstance(record.get(k), str)
                                                   for k in (s.prompt_field, s.completion_field)):
            return f"fields '{s.prompt_field}' and '{s.completion_field}' are not both strings"
        return None

    def encode(self, records: list[dict[str, Any]]) -> list[tuple[list[int], list[int]]]:
        """``(ids, labels)`` of each record, in order; ``BadRecord`` names the first that fails."""
        out: list[tuple[list[int], list[int]] | None] = [None] * len(records)
        groups: dict[str, list[int]] = {}
        for i, r in enumerate(records):
            groups.setdefault(self.mode(r), []).append(i)
        for mode, idx in groups.items():
            try:
                encoded = self._encode(mode, [records[i] for i in idx], idx)
            except Exception:  # noqa: BLE001 - find the record that fails, one at a time
                for i in idx:
                    try:
                        self._encode(mode, [records[i]], [i])
                    except Exception as exc:  # noqa: BLE001
                        raise BadRecord(i, str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None
                raise
            for i, pair in zip(idx, encoded):
                out[i] = pair
        return out  # type: ignore[return-value]

    def _encode(self, mode: str, records: list[dict[str, Any]], indices: list[int]) -> list[tuple[list[int], list[int]]]:
        if mode not in self._encoders:
            self._encoders[mode] = Encoder(self.tokenizer, self.spec, mode)
        keys = {k for r in records for k in r}
        batch = {k: [r.get(k) for r in records] for k in keys}
        ids, labels = self._encoders[mode].encode(batch, indices)
        return [(list(a), list(b)) for a, b in zip(ids, labels)]
