"""Rank-0 JSON-lines logs of training and validation metrics, kept consistent across resumes."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from automodel_ckpt.jsonsafe import json_safe



class JsonlLog:
    """One JSON object per line, flushed at every write so a killed run keeps everything it logged."""

    def __init__(self, path: Path, enabled: bool = True) -> None:
        self.path = Path(path)
        self.enabled = enabled

    def append(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps({k: json_safe(v) for k, v in record.items()}) + "\n")

    def truncate_after(self, step: int) -> None:
        """Drop records of steps after ``step``: a resumed run rewrites the steps it repeats."""
        if not self.enabled or not self.path.exists():
            return
        kept = [line for line in self.path.read_text(encoding="utf-8").splitlines() if _step_of(line) <= step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        tmp.replace(self.path)


def _step_of(line: str) -> float:
    try:
        return float(json.loads(line).get("step", math.inf))
    except (ValueError, AttributeError):
        return math.inf


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # a line cut by a kill mid-write
    return out
