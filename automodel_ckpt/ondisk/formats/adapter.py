"""The ``adapter`` model format: a PEFT model's Hugging Face adapter folder (``peft``), whatever the configuration.

A PEFT model is saved so whatever ``checkpoint.model_save_format`` names; the folder is never exported."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from automodel_ckpt.ondisk import layout
from automodel_ckpt.ondisk.formats import peft
from automodel_ckpt.ondisk.formats.base import ModelFormat

NAME = "adapter"


class AdapterFolder:
    """A PEFT model's files: its Hugging Face adapter folder (``peft.save_adapter``), always written at once."""

    def __init__(self, rank: int, *, base_model_path: Path | None = None, tokenizer: Any = None,
                 peft_section: dict[str, Any] | None = None) -> None:
        self.rank, self.base_model_path = rank, base_model_path
        self.tokenizer, self.peft_section = tokenizer, peft_section

    def write_model(self, model: Any, path: Path, stager: Any = None, written: Any = None,
                    threads: int | None = None) -> None:
        """Collective: the adapter folder written now (nothing is staged for the background)."""
        peft.save_adapter(model, path, rank=self.rank, base_model_path=self.base_model_path,
                          tokenizer=self.tokenizer, peft_section=self.peft_section)


class Adapter(ModelFormat):
    name = NAME
    files = f"a PEFT {layout.ADAPTER_CONFIG}"
    configurable = False
    export_refusal = "holds a PEFT adapter, not model shards; use `ckpt-train merge-lora` for a full HF model"

    def detect(self, folder: Path) -> bool:
        folder = Path(folder)
        return (folder / layout.ADAPTER_WEIGHTS).is_file() or (folder / layout.ADAPTER_CONFIG).is_file()

    def claims(self, model: Any) -> bool:
        return peft.is_peft_model(model)

    def accepts(self, model: Any) -> bool:
        return peft.is_peft_model(model)

    def writer(self, *, rank: int, reuse: Any = None, hf: Any = None) -> AdapterFolder:
        return AdapterFolder(rank, base_model_path=getattr(hf, "base_model_path", None),
                             tokenizer=getattr(hf, "tokenizer", None), peft_section=getattr(hf, "peft", None))

    def load(self, model: Any, folder: Path, check: Any = None) -> None:
        peft.load_adapter(model, folder)

    def substitute_warning(self, configured: ModelFormat) -> str:
        return (f"checkpoint.model_save_format={configured.name} does not apply to PEFT models; saving the adapter "
                "in Hugging Face PEFT format (safetensors)")


FORMAT = Adapter()
