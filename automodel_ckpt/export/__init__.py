"""Exports of checkpoints: Hugging Face folders, archives, quantized models and merged LoRA adapters, and their face.

A checkpoint's model becomes a Hugging Face folder (``plan`` and the modules it uses; ``verify``), an archive read in
place (``archive*``), a quantized file or folder (one ``*_target`` module each, in ``registry``) or a base with its
LoRA adapter merged (``lora_merge``); ``model_source`` opens any of them as a source for the others. It works
through ``automodel_ckpt.ondisk``'s face and never imports the engine (``automodel_ckpt.checkpoint``), which imports
it. Code outside imports only the names below (``tests/unit/test_structure.py``), loaded on first use.
"""

from __future__ import annotations

from automodel_ckpt.faces import exports_of, lazy_members

# module below this package -> the names of its members that the face hands on
_EXPORTS = exports_of({
    # Hugging Face folders: consolidation, its plan, the checks of a finished export
    "plan": "consolidate build_plan parse_cast_dtype resolve_model_dir",
    "script": "render_consolidate_script",
    "hf_metadata": "write_hf_metadata",
    "verify": "verify_export print_report",
    # any model folder, archive or checkpoint as a source; LoRA merged into its base
    "model_source": "open_model ModelSource",
    "lora_merge": "merge_lora",
    # archives: one file holding a model folder, read in place
    "archive": "is_archive open_archive describe_archive verify_archive",
    "archive_weights": "ArchiveHFReader",
    "archive_pack": "pack pack_into pack_summary",
    # where a model came from: its training and export lineage
    "lineage": "lineage_fingerprint lineage_parent training_lineage export_lineage data_identity read_lineage",
    "commit": "write_lineage_file",
    "lineage_walk": "lineage_chain",
    # an int8 folder read back as a model (its weights dequantized)
    "int8_read": "is_int8 dequantize_int8",
    # the targets of `ckpt-train export --to NAME`, by name, and which one a file is
    "target": "ExportTarget ExportRequest",
    "registry": "register_target unregister_target get_target export_targets target_names identify DEFAULT_TARGET",
})

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_members(__name__, _EXPORTS, globals())
