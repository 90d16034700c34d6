"""Records of a streamed corpus to token ids and loss labels, rendered as the tokenize-up-front path renders them.

Text, prompt and completion, templates and chat go through that path's ``Encoder``; a record is kept whole (never
cut to ``seq_length``: the packer carries its tail over).
"""

from __future__ import annotations

from typing import Any

from automodel_ckpt.data.encode import DataSpec, Encoder
from automodel_ckpt.errors import UserError


class BadRecord(Exception):
    """Record ``index`` of a batch cannot be encoded; ``reason`` says why in a few words."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(reason)
        self.index, self.reason = index, reason


class RecordEncoder:
    """``check(record)``: why a record cannot be encoded (``None``: it can); ``encode(records)``: their
    ``(ids, labels)``. A record's mode (chat, template, prompt_completion, text) follows ``DataSpec.mode``."""

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
