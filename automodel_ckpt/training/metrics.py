"""Rank-0 JSON-lines logs of training and validation metrics, kept consistent across resumes."""

from __future__ import annotations

import errno
import json
import math
import os
import stat
from pathlib import Path
from typing import Any, Iterator

from automodel_ckpt.ondisk import LOG_LINE_LIMIT, file_kind, open_regular, write_atomic
from automodel_ckpt.errors import UserError, first_line
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
        line = (json.dumps({k: json_safe(v) for k, v in record.items()}) + "\n").encode("utf-8")
        fd = _open_append(self.path)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    def truncate_after(self, step: int) -> None:
        """Drop records of steps after ``step``: a resumed run rewrites the steps it repeats."""
        if not self.enabled or not os.path.lexists(self.path):
            return
        kept = [line.rstrip("\n") + "\n" for line in log_lines(self.path) if _step_of(line) <= step]
        write_atomic(self.path, "".join(kept).encode("utf-8"))


def _step_of(line: str) -> float:
    try:
        return float(json.loads(line).get("step", math.inf))
    except (ValueError, AttributeError, TypeError, RecursionError):
        return math.inf


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return list(iter_jsonl(path))


def iter_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """A log's records one at a time (``log_lines``); a line that is no JSON object (cut by a kill) is skipped."""
    for line in log_lines(Path(path)):
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):  # RecursionError: a line nested too deeply to be a record
            continue
        if isinstance(record, dict):
            yield record


def _open_append(path: Path) -> int:
    """``path`` opened for appending; anything but a regular file there is refused (``UserError``)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
            raise
        fd = None
    if fd is not None and stat.S_ISREG(os.fstat(fd).st_mode):
        os.set_blocking(fd, True)
        return fd
    if fd is not None:
        os.close(fd)
    raise UserError(f"the log '{path}' is {file_kind(os.lstat(path).st_mode)}, not a regular file; logs are "
                    "appended only to regular files of the run: remove it")


def log_lines(path: Path) -> Iterator[str]:
    """A log's lines, read one at a time (a run folder received from elsewhere may hold a log of any size); a line
    longer than ``bounded.LOG_LINE_LIMIT`` is skipped, never held whole; anything but a regular file is refused."""
    try:
        f = os.fdopen(open_regular(path), "rb")
    except FileNotFoundError:
        return
    except OSError as exc:
        raise UserError(f"cannot read the log '{path}': {first_line(exc)}; logs are read only as regular files: "
                        "remove it") from None
    with f:
        while line := f.readline(LOG_LINE_LIMIT + 1):
            if len(line) > LOG_LINE_LIMIT:
                while line and not line.endswith(b"\n"):  # the rest of an over-long line
                    line = f.readline(LOG_LINE_LIMIT + 1)
                continue
            yield line.decode("utf-8", "replace")
