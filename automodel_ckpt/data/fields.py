"""Record templates: text built from a record's fields, nested ones included (``{answers.text[0]}``)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from automodel_ckpt.errors import ConfigError

# A placeholder is a field path: name(.name | [int] | [name])*; `{{` and `}}` are literal braces.
_TOKEN = re.compile(r"\{\{|\}\}|\{([^{}]*)\}")
_STEP = re.compile(r"\.?([A-Za-z_][\w\- ]*)|\[(-?\d+)\]|\[([A-Za-z_][\w.]*)\]")


@dataclass(frozen=True)
class FieldPath:
    """One placeholder: ``answers.text[0]`` is ``("answers", "text", 0)``; ``endings[label]`` indexes by a field."""

    text: str
    steps: tuple[str | int | "FieldPath", ...]

    @classmethod
    def parse(cls, text: str, key: str) -> "FieldPath":
        steps: list[str | int | FieldPath] = []
        pos = 0
        spec = text.strip()
        while pos < len(spec):
            m = _STEP.match(spec, pos)
            if m is None or (pos == 0 and spec.startswith((".", "["))):
                raise ConfigError(f"{key}: cannot read the field '{{{text}}}' (use name, name.sub, name[0] or "
                                  "name[other_field])")
            if m.group(1) is not None:
                steps.append(m.group(1))
            elif m.group(2) is not None:
                steps.append(int(m.group(2)))
            else:
                steps.append(FieldPath.parse(m.group(3), key))
            pos = m.end()
        if not steps:
            raise ConfigError(f"{key}: empty field '{{}}' (write '{{{{' for a literal brace)")
        return cls(spec, tuple(steps))

    def resolve(self, record: dict[str, Any]) -> Any:
        """The value at this path; KeyError naming the path when any step is missing."""
        value: Any = record
        for step in self.steps:
            if isinstance(step, FieldPath):
                step = _as_index(step.resolve(record), step.text)
            try:
                value = value[step]
            except (KeyError, IndexError, TypeError):
                raise KeyError(self.text) from None
            if value is None:
                raise KeyError(self.text)
        return value


def _as_index(value: Any, text: str) -> int | str:
    if isinstance(value, str) and value.lstrip("-").isdigit():
        return int(value)  # HellaSwag stores its label as a string
    if isinstance(value, (int, str)):
        return value
    raise KeyError(text)


class RecordTemplate:
    """``"{context}\\n\\nQuestion: {question}"`` rendered against one record at a time."""

    def __init__(self, template: str, key: str) -> None:
        self.template = template
        self.key = key
        self._parts: list[str | FieldPath] = []
        pos = 0
        literals = []
        for m in _TOKEN.finditer(template):
            literals.append(template[pos:m.start()])
            self._parts.append(literals[-1])
            token = m.group(0)
            self._parts.append(token[0] if token in ("{{", "}}") else FieldPath.parse(m.group(1), key))
            pos = m.end()
        literals.append(template[pos:])
        self._parts.append(literals[-1])
        if any(ch in text for text in literals for ch in "{}"):
            raise ConfigError(f"{key}: unbalanced brace in template {template!r} (write '{{{{' or '}}}}' for a literal one)")

    @property
    def fields(self) -> list[str]:
        return [p.text for p in self._parts if isinstance(p, FieldPath)]

    def render(self, record: dict[str, Any], record_number: int) -> str:
        out = []
        for part in self._parts:
            if isinstance(part, str):
                out.append(part)
                continue
            try:
                out.append(str(part.resolve(record)))
            except KeyError:
                raise ConfigError(
                    f"dataset: record {record_number} has no field '{part.text}' (used by {self.key}); "
                    f"its fields are: {', '.join(sorted(record))}"
                ) from None
        return "".join(out)
