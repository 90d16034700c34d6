"""The checkpoint folder and its bytes: the contract with every checkpoint on disk, and its one public face.

Everything a checkpoint folder holds is spelled and read here, versioned by ``layout.LAYOUT_VERSION``: file names
(``layout``), limits on untrusted files (``bounded``), the path validator (``paths``), metadata, the manifest and
its checksums, durable writes, the catalog of a run folder, the byte formats (``formats/``: sharded model and
optimizer state, PEFT adapters, safetensors, the only reader of pickles, parallel file I/O) and the exports
(``export/``: Hugging Face folders, archives, GGUF, int8). It never imports the engine that writes checkpoints
(``automodel_ckpt.checkpoint``).

Code outside this package and ``checkpoint`` imports only the names below (``tests/unit/test_structure.py``);
the modules inside are private to the two packages. The names load on first use, so reading a run folder
(``inspect``, ``verify``) imports no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> (module below this package, its name there)
_EXPORTS = {
    # the vocabularies of the contract, as modules: file names, limits on untrusted files, path checks
    "layout": ("layout", None),
    "bounded": ("bounded", None),
    "paths": ("paths", None),
    "catalog": ("catalog", None),
    "manifest": ("manifest", None),
    # what a save wrote
    "HFArtifacts": ("info", "HFArtifacts"),
    "SaveInfo": ("info", "SaveInfo"),
    "WrittenBy": ("info", "WrittenBy"),
    "written_by": ("metadata", "written_by"),
    "as_float": ("metadata", "as_float"),
    "run_fingerprint": ("fingerprint", "run_fingerprint"),
    "shared_bytes": ("incremental", "shared_bytes"),  # checkpoint.incremental: own / shared bytes of a checkpoint
    "stored_once": ("incremental", "stored_once"),
    "write_atomic": ("durable", "write_atomic"),
    "fsync_file": ("durable", "fsync_file"),
    "detect_model_format": ("formats.detect", "detect_model_format"),
    "load_pt": ("formats.safe_load", "load_pt"),
    "read_dcp_folder": ("formats.dcp_folder", "read_dcp_folder"),
    "READ_THREADS": ("formats.fastio", "READ_THREADS"),
    # save coordination: the planner and the write results' cache (what tools/bench_scale.py simulates)
    "planning": ("formats.planning", None),
    "plan_results": ("formats.plan_results", None),
    "WRITE_THREADS": ("formats.fastio", "WRITE_THREADS"),
    # exports: Hugging Face folders, archives, GGUF, int8, LoRA merged
    "consolidate": ("export.plan", "consolidate"),
    "build_plan": ("export.plan", "build_plan"),
    "parse_cast_dtype": ("export.plan", "parse_cast_dtype"),
    "resolve_model_dir": ("export.plan", "resolve_model_dir"),
    "verify_export": ("export.verify", "verify_export"),
    "print_report": ("export.verify", "print_report"),
    "open_model": ("export.model_source", "open_model"),
    "merge_lora": ("export.merge_lora", "merge_lora"),
    "is_archive": ("export.archive", "is_archive"),
    "describe_archive": ("export.archive", "describe"),
    "verify_archive": ("export.archive", "verify"),
    "pack": ("export.pack", "pack"),
    "pack_into": ("export.pack", "pack_into"),
    "pack_summary": ("export.pack", "summary"),
    "is_gguf": ("export.gguf_read", "is_gguf"),
    "describe_gguf": ("export.gguf_read", "describe_gguf"),
    "verify_gguf": ("export.gguf_read", "verify_gguf"),
    "plan_gguf": ("export.gguf_export", "plan_gguf"),
    "write_gguf": ("export.gguf_export", "write_gguf"),
    "write_gguf_adapter": ("export.gguf_adapter", "write_gguf_adapter"),
    "plan_int8": ("export.int8_export", "plan_int8"),
    "write_int8": ("export.int8_export", "write_int8"),
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from automodel_ckpt.ondisk import bounded, catalog, layout, manifest, paths
    from automodel_ckpt.ondisk.durable import fsync_file, write_atomic
    from automodel_ckpt.ondisk.export.archive import describe as describe_archive
    from automodel_ckpt.ondisk.export.archive import is_archive
    from automodel_ckpt.ondisk.export.archive import verify as verify_archive
    from automodel_ckpt.ondisk.export.gguf_adapter import write_gguf_adapter
    from automodel_ckpt.ondisk.export.gguf_export import plan_gguf, write_gguf
    from automodel_ckpt.ondisk.export.gguf_read import describe_gguf, is_gguf, verify_gguf
    from automodel_ckpt.ondisk.export.int8_export import plan_int8, write_int8
    from automodel_ckpt.ondisk.export.merge_lora import merge_lora
    from automodel_ckpt.ondisk.export.model_source import open_model
    from automodel_ckpt.ondisk.export.pack import pack, pack_into
    from automodel_ckpt.ondisk.export.pack import summary as pack_summary
    from automodel_ckpt.ondisk.export.plan import build_plan, consolidate, parse_cast_dtype, resolve_model_dir
    from automodel_ckpt.ondisk.export.verify import print_report, verify_export
    from automodel_ckpt.ondisk.fingerprint import run_fingerprint
    from automodel_ckpt.ondisk.formats.dcp_folder import read_dcp_folder
    from automodel_ckpt.ondisk.formats.detect import detect_model_format
    from automodel_ckpt.ondisk.formats.fastio import READ_THREADS, WRITE_THREADS
    from automodel_ckpt.ondisk.incremental import shared_bytes, stored_once
    from automodel_ckpt.ondisk.info import HFArtifacts, SaveInfo, WrittenBy
    from automodel_ckpt.ondisk.metadata import as_float, written_by


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = _EXPORTS[name]
    loaded = importlib.import_module(f"{__name__}.{module}")
    value = loaded if attr is None else getattr(loaded, attr)
    globals()[name] = value
    return value
