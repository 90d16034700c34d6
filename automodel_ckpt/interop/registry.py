"""The import sources, by name: each is one module of this package, registered here by one line.

The first registered source that ``detect``s SRC reads it (``read_source``); ``register_source`` adds one from
outside.
"""

from __future__ import annotations

from pathlib import Path

from automodel_ckpt.errors import CheckpointError
from automodel_ckpt.interop import deepspeed, hf_trainer, lightning, torchtitan
from automodel_ckpt.interop.contract import ImportSource
from automodel_ckpt.interop.source import ForeignRun, Limits
from automodel_ckpt.registry import Registry

_SOURCES: Registry[ImportSource] = Registry("an import source", lambda name, names: KeyError(name))  # never ``get``


def register_source(source: ImportSource) -> ImportSource:
    """Add ``source`` (an ``ImportSource`` with its ``name``); registering a name again replaces its source."""
    if not source.noun:
        raise ValueError(f"an import source needs a name and a noun, got {source!r}")
    return _SOURCES.register(source)


def unregister_source(name: str) -> None:
    """Remove the source ``name`` (a plug-in's, when it is done)."""
    _SOURCES.unregister(name)


register_source(deepspeed.SOURCE)  # before the HF Trainer: its checkpoint-N/ may hold a DeepSpeed tag folder
register_source(torchtitan.SOURCE)  # before Lightning's folder: a step-N/ folder holds a DCP .metadata too
register_source(hf_trainer.SOURCE)
register_source(lightning.FILE_SOURCE)
register_source(lightning.FOLDER_SOURCE)


def source_names() -> list[str]:
    return _SOURCES.names()


def identify(path: Path) -> ImportSource | None:
    """The source whose checkpoint ``path`` is (asked in registration order); None when it is no source's."""
    return _SOURCES.first(lambda s: s.detect(Path(path)))


def read_source(src: Path, limits: Limits) -> ForeignRun:
    """The ``ForeignRun`` of ``src`` within ``limits``; a one-line ``CheckpointError`` otherwise."""
    src = Path(src)
    if not src.exists():
        raise CheckpointError(f"'{src}' does not exist")
    source = identify(src)
    if source is None:
        nouns = [s.noun for s in _SOURCES]
        kinds = nouns[0] if len(nouns) == 1 else f"{', '.join(nouns[:-1])} nor {nouns[-1]}"
        raise CheckpointError(f"'{src}' is {'not' if len(nouns) == 1 else 'neither'} {kinds}")
    return source.read(src, limits)
