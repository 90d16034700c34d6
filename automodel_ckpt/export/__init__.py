"""Exports of checkpoints: Hugging Face folders, archives, GGUF, int8 and merged LoRA adapters, and their one face.

A checkpoint's model becomes a Hugging Face folder (``plan``: the plan, shard sources, writer, atomic commit, HF
metadata, the ``consolidate.sh`` script; ``verify``), one archive file read in place (``archive_pack``, ``archive``,
``archive_weights``), a GGUF file (``gguf_*``), an int8 folder (``int8_*``) or a base model with its LoRA adapter
merged (``lora_merge``); ``model_source`` opens any of them as a source for the others. It reads and writes through
``automodel_ckpt.ondisk`` (the folder's contract, below it) and never imports the engine
(``automodel_ckpt.checkpoint``), which imports it.

Code outside this package imports only the names below, each a member of a module here under its own name
(``tests/unit/test_structure.py``). The names load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from automodel_ckpt.faces import lazy_members

# name -> (module below this package, its name there: the same, a member keeps its own name)
_EXPORTS = {
    # Hugging Face folders: consolidation, its plan, the checks of a finished export
    "consolidate": ("plan", "consolidate"),
    "build_plan": ("plan", "build_plan"),
    "parse_cast_dtype": ("plan", "parse_cast_dtype"),
    "resolve_model_dir": ("plan", "resolve_model_dir"),
    "render_consolidate_script": ("script", "render_consolidate_script"),
    "write_hf_metadata": ("hf_metadata", "write_hf_metadata"),
    "verify_export": ("verify", "verify_export"),
    "print_report": ("verify", "print_report"),
    # any model folder, archive or checkpoint as a source; LoRA merged into its base
    "open_model": ("model_source", "open_model"),
    "merge_lora": ("lora_merge", "merge_lora"),
    # archives: one file holding a model folder, read in place
    "is_archive": ("archive", "is_archive"),
    "open_archive": ("archive", "open_archive"),
    "describe_archive": ("archive", "describe_archive"),
    "verify_archive": ("archive", "verify_archive"),
    "ArchiveHFReader": ("archive_weights", "ArchiveHFReader"),
    "pack": ("archive_pack", "pack"),
    "pack_into": ("archive_pack", "pack_into"),
    "pack_summary": ("archive_pack", "pack_summary"),
    # GGUF files for llama.cpp
    "is_gguf": ("gguf_read", "is_gguf"),
    "lineage_chain": ("lineage", "lineage_chain"),
    "lineage_fingerprint": ("lineage", "lineage_fingerprint"),
    "lineage_parent": ("lineage", "lineage_parent"),
    "lineage_json": ("lineage", "lineage_json"),
    "training_lineage": ("lineage", "training_lineage"),
    "export_lineage": ("lineage", "export_lineage"),
    "data_identity": ("lineage", "data_identity"),
    "read_lineage": ("lineage", "read_lineage"),
    "write_lineage_file": ("lineage", "write_lineage_file"),
    "describe_gguf": ("gguf_read", "describe_gguf"),
    "verify_gguf": ("gguf_read", "verify_gguf"),
    "plan_gguf": ("gguf_export", "plan_gguf"),
    "write_gguf": ("gguf_export", "write_gguf"),
    "write_gguf_adapter": ("gguf_adapter", "write_gguf_adapter"),
    "open_gguf_tensors": ("gguf_tensors", "open_gguf_tensors"),
    "gguf_mapping": ("gguf_tensors", "gguf_mapping"),
    # int8 folders for vLLM
    "plan_int8": ("int8_export", "plan_int8"),
    "write_int8": ("int8_export", "write_int8"),
    "is_int8": ("int8_read", "is_int8"),
    "dequantize_int8": ("int8_read", "dequantize_int8"),
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from automodel_ckpt.export.archive import describe_archive, is_archive, open_archive, verify_archive
    from automodel_ckpt.export.archive_pack import pack, pack_into, pack_summary
    from automodel_ckpt.export.archive_weights import ArchiveHFReader
    from automodel_ckpt.export.gguf_adapter import write_gguf_adapter
    from automodel_ckpt.export.gguf_export import plan_gguf, write_gguf
    from automodel_ckpt.export.gguf_read import describe_gguf, is_gguf, verify_gguf
    from automodel_ckpt.export.gguf_tensors import gguf_mapping, open_gguf_tensors
    from automodel_ckpt.export.lineage import (data_identity, export_lineage, lineage_chain, lineage_fingerprint,
                                               lineage_json, lineage_parent, read_lineage, training_lineage,
                                               write_lineage_file)
    from automodel_ckpt.export.hf_metadata import write_hf_metadata
    from automodel_ckpt.export.int8_export import plan_int8, write_int8
    from automodel_ckpt.export.int8_read import dequantize_int8, is_int8
    from automodel_ckpt.export.lora_merge import merge_lora
    from automodel_ckpt.export.model_source import open_model
    from automodel_ckpt.export.plan import build_plan, consolidate, parse_cast_dtype, resolve_model_dir
    from automodel_ckpt.export.script import render_consolidate_script
    from automodel_ckpt.export.verify import print_report, verify_export


__getattr__ = lazy_members(__name__, _EXPORTS, globals())
