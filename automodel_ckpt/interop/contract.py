"""What an import source is: ``ImportSource``, the object each source module registers, and what it must bring.

A source is one trainer's checkpoint kind (an HF Trainer ``checkpoint-N/`` folder, a Lightning ``.ckpt`` file, ...).
It says whether a path is one of its checkpoints (``detect``) and reads it into the common form the rest of
``interop`` uses, a ``source.ForeignRun``: the weights under the source's names, AdamW's two moments and step per
optimizer slot with its param groups, the optimizer step, the learning-rate schedule (``source.Schedule``) and the
data position (``ForeignRun.position``: epoch, steps taken in it, steps per epoch for the recipe's rows), with its
random generators' state where it has one. ``registry`` asks the sources in registration order; ``import`` knows no
source by name.

The invariant every source keeps: ``detect`` decides from names and kinds of entries (``os.path.lexists``,
``is_dir``, a suffix) or, where it must look inside, a bounded read of a regular file (``source.read_bytes``); it
never follows a link inside the path and never raises. ``read`` reads every file through ``source.read_bytes`` /
``load_pickle`` / ``read_json``, bounded by ``limits`` (``source.Limits``), and checks each value it carries before
use: bad input is one ``CheckpointError`` line naming the file and the field.
"""

from __future__ import annotations

from pathlib import Path

from automodel_ckpt.interop.source import ForeignRun, Limits


class ImportSource:
    """One import source. Subclasses set ``name`` and ``noun`` and implement ``detect`` and ``read``."""

    name: str = ""  # a short name ("hf-trainer"): the registry's key
    noun: str = ""  # one of its checkpoints, in words, with what marks it ("a Lightning .ckpt file")

    def detect(self, path: Path) -> bool:
        """Whether ``path`` is one of its checkpoints (names and kinds of entries, or a bounded read; no raise)."""
        return False

    def read(self, path: Path, limits: Limits) -> ForeignRun:
        """``path`` read into a ``ForeignRun``, its files within ``limits``; one-line ``CheckpointError`` otherwise."""
        raise NotImplementedError
