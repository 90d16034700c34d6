"""What an import source is: ``ImportSource``, the object each source module registers.

A source reads one trainer's kind of checkpoint into a ``source.ForeignRun`` (docs/import.md). ``detect`` decides
from the names and kinds of entries, or a bounded read of a regular file: it never follows a link inside the path and
never raises. ``read`` reads every file through ``source``'s bounded readers within ``limits`` and checks each value
before use: bad input is one ``CheckpointError`` line naming the file and the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from automodel_ckpt.interop.source import ForeignRun, Limits


class ImportSource:
    """One import source: given its ``name``, ``noun``, ``detect`` and ``read``, or a subclass setting them."""

    name: str = ""  # a short name ("hf-trainer"): the registry's key
    noun: str = ""  # one of its checkpoints, in words, with what marks it ("a Lightning .ckpt file")

    def __init__(self, name: str = "", noun: str = "", detect: Callable[[Path], bool] | None = None,
                 read: Callable[[Path, Limits], ForeignRun] | None = None) -> None:
        given = {"name": name, "noun": noun, "detect": detect, "read": read}
        self.__dict__.update({k: v for k, v in given.items() if v})

    def detect(self, path: Path) -> bool:
        """Whether ``path`` is one of its checkpoints (names and kinds of entries, or a bounded read; no raise)."""
        return False

    def read(self, path: Path, limits: Limits) -> ForeignRun:
        """``path`` read into a ``ForeignRun``, its files within ``limits``; one-line ``CheckpointError`` otherwise."""
        raise NotImplementedError
