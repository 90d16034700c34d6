"""Lightning checkpoints (a ``.ckpt`` file, a distributed checkpoint folder) read into a ``ForeignRun``."""

from __future__ import annotations

from pathlib import Path


def is_lightning_file(src: Path) -> bool:
    return src.is_file() and src.suffix == ".ckpt"


def is_lightning_folder(src: Path) -> bool:
    return src.is_dir() and (src / ".metadata").is_file()
