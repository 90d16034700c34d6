"""What a checkpoint model format is to the engine: ``ModelFormat``, the object each format module registers.

A format writes, stages, loads, recognises and opens for the export a model's files; ``registry`` finds it."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol


class ModelWriter(Protocol):
    """How a save writes one model's files: now, or (with a ``stager``) staged for a background write."""

    def write_model(self, model: Any, path: Path, stager: Any, written: Any = None,
                    threads: int | None = None) -> Any:
        """Collective: ``model``'s state into ``path``; a ``sharded.StagedSave`` for the background, or None."""


class ModelFormat:
    """One model format: ``name``, ``detect``, ``writer``, ``load`` and, where the export reads it, ``open_source``."""

    name: str = ""  # ``checkpoint.model_save_format``'s value, recorded in metadata.json
    files: str = ""  # its files, as an error names them ("shard-*.safetensors files")
    configurable: bool = True  # a value of ``checkpoint.model_save_format`` (False: a format some models claim)
    exports_inline: bool = False  # ``save_consolidated`` exports inline; ``consolidate.sh`` is written beside it
    holds_adapters: bool = False  # a PEFT model saved under it as its adapter folder needs no warning
    export_refusal: str | None = None  # why a folder of this format is not exported (None: it is)

    def detect(self, folder: Path) -> bool:
        """Whether the existing folder ``folder`` holds this format's files (the registry asks in its order)."""
        raise NotImplementedError

    def claims(self, model: Any) -> bool:
        """Whether ``model`` is always saved in this format, whatever ``model_save_format`` says (a PEFT model)."""
        return False

    def accepts(self, model: Any) -> bool:
        """Whether ``model`` can be loaded from this format's files (a format that claims models loads only those)."""
        return True

    def writer(self, *, rank: int, reuse: Any = None, hf: Any = None) -> ModelWriter:
        """What a save writes models with: ``reuse`` (``checkpoint.incremental``), ``hf`` (``info.HFArtifacts``)."""
        raise NotImplementedError

    def load(self, model: Any, folder: Path, check: Any = None) -> None:
        """Collective: load ``folder`` into ``model``'s sharding; ``check``: checksums the files it reads."""
        raise NotImplementedError

    def open_source(self, folder: Path, saved_world_size: int | None = None) -> Any:
        """The folder's tensors as pieces of its files (``pieces.ShardSource``) for the Hugging Face export;
        ``saved_world_size``: the ranks that wrote it, where the files cannot tell a missing last rank."""
        raise NotImplementedError(f"model format '{self.name}' has no export source")

    def substitute_warning(self, configured: ModelFormat) -> str:
        """The warning a save gives where a model this format claims is saved in it instead of ``configured``."""
        return (f"checkpoint.model_save_format={configured.name} does not apply to this model; saving it in "
                f"{self.name} format")

    def __repr__(self) -> str:
        return f"<model format {self.name}>"
