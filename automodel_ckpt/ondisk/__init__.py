"""The checkpoint folder and its bytes: the contract with every checkpoint on disk, and its one public face.

Everything a checkpoint folder holds is spelled and read here, versioned by ``layout.LAYOUT_VERSION``: file names
(``layout``), limits on untrusted files (``bounded``), the path validator (``paths``), metadata, the manifest and
its checksums, durable writes, the catalog of a run folder, the byte formats (``formats/``: sharded model and
optimizer state, PEFT adapters, safetensors, the only reader of pickles, parallel file I/O). It never imports the
exports (``automodel_ckpt.export``) nor the engine that writes checkpoints (``automodel_ckpt.checkpoint``).

Code outside this package, ``export`` and ``checkpoint`` imports only the names below, each a member of a module here
under its own name, never a whole module (``tests/unit/test_structure.py``): what that code reads, nothing more. The
layout's file names and path builders are one of them, the table ``LAYOUT`` (``LAYOUT.HF_CONFIG``). The modules
inside are private to the three packages (benchmarks that time them aside, each saying so). The names load on first
use, so reading a run folder (``inspect``, ``verify``) imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from automodel_ckpt.faces import lazy_members

# name -> (module below this package, its name there)
_EXPORTS = {
    # the file and folder names of a run folder and a checkpoint, and their path builders, as one table (layout)
    "LAYOUT": ("layout_table", "LAYOUT"),
    # limits on untrusted files and the bounded readers (bounded)
    "CONFIG_FILE_LIMIT": ("bounded", "CONFIG_FILE_LIMIT"),
    "INDEX_FILE_LIMIT": ("bounded", "INDEX_FILE_LIMIT"),
    "LOG_FILE_LIMIT": ("bounded", "LOG_FILE_LIMIT"),
    "LOG_LINE_LIMIT": ("bounded", "LOG_LINE_LIMIT"),
    "MAX_DEPTH": ("bounded", "MAX_DEPTH"),
    "SMALL_FILE_LIMIT": ("bounded", "SMALL_FILE_LIMIT"),
    "MiB": ("bounded", "MiB"),
    "check_size": ("bounded", "check_size"),
    "parse_json": ("bounded", "parse_json"),
    "read_bytes": ("bounded", "read_bytes"),
    "read_json": ("bounded", "read_json"),
    "read_yaml": ("bounded", "read_yaml"),
    "yaml_depth_line": ("bounded", "yaml_depth_line"),
    # path checks on names read from files (paths)
    "check_path": ("paths", "check_path"),
    "file_kind": ("paths", "file_kind"),
    "is_plain_name": ("paths", "is_plain_name"),
    "model_file_in": ("paths", "model_file_in"),
    "open_regular": ("paths", "open_regular"),
    "path_inside": ("paths", "path_inside"),
    "regular_file_problem": ("paths", "regular_file_problem"),
    # the catalog of a run folder: its checkpoints and pointers (catalog)
    "CheckpointRecord": ("catalog", "CheckpointRecord"),
    "list_checkpoints": ("catalog", "list_checkpoints"),
    "pointer_target": ("catalog", "pointer_target"),
    "pointer_targets": ("catalog", "pointer_targets"),
    "quarantined_checkpoints": ("catalog", "quarantined_checkpoints"),
    "scan_checkpoints": ("catalog", "scan_checkpoints"),
    "size_on_disk": ("catalog", "size_on_disk"),
    # the manifest: reading, verifying, extending it (manifest)
    "CHECKSUM_MISMATCH": ("manifest", "CHECKSUM_MISMATCH"),
    "UNEXPECTED_FILE": ("manifest", "UNEXPECTED_FILE"),
    "ManifestReport": ("manifest", "ManifestReport"),
    "add_files_to_manifest": ("manifest", "add_files_to_manifest"),
    "read_manifest": ("manifest", "read_manifest"),
    "verify_manifest": ("manifest", "verify_manifest"),
    # a checkpoint's metadata, its bytes shared with others, durable writes, reading model files
    "as_float": ("metadata", "as_float"),
    "run_fingerprint": ("fingerprint", "run_fingerprint"),
    "shared_bytes": ("incremental", "shared_bytes"),  # checkpoint.incremental: own / shared bytes of a checkpoint
    "stored_once": ("incremental", "stored_once"),
    "write_atomic": ("durable", "write_atomic"),
    "fsync_file": ("durable", "fsync_file"),
    "detect_model_format": ("formats.detect", "detect_model_format"),
    "load_pt": ("formats.safe_load", "load_pt"),
    "read_dcp_folder": ("formats.dcp_folder", "read_dcp_folder"),
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from automodel_ckpt.ondisk.bounded import (CONFIG_FILE_LIMIT, INDEX_FILE_LIMIT, LOG_FILE_LIMIT, LOG_LINE_LIMIT,
                                               MAX_DEPTH, SMALL_FILE_LIMIT, MiB, check_size, parse_json, read_bytes,
                                               read_json, read_yaml, yaml_depth_line)
    from automodel_ckpt.ondisk.catalog import (CheckpointRecord, list_checkpoints, pointer_target, pointer_targets,
                                               quarantined_checkpoints, scan_checkpoints, size_on_disk)
    from automodel_ckpt.ondisk.durable import fsync_file, write_atomic
    from automodel_ckpt.ondisk.fingerprint import run_fingerprint
    from automodel_ckpt.ondisk.formats.dcp_folder import read_dcp_folder
    from automodel_ckpt.ondisk.formats.detect import detect_model_format
    from automodel_ckpt.ondisk.formats.safe_load import load_pt
    from automodel_ckpt.ondisk.incremental import shared_bytes, stored_once
    from automodel_ckpt.ondisk.layout_table import LAYOUT
    from automodel_ckpt.ondisk.manifest import (CHECKSUM_MISMATCH, UNEXPECTED_FILE, ManifestReport,
                                                add_files_to_manifest, read_manifest, verify_manifest)
    from automodel_ckpt.ondisk.metadata import as_float
    from automodel_ckpt.ondisk.paths import (check_path, file_kind, is_plain_name, model_file_in, open_regular,
                                             path_inside, regular_file_problem)


__getattr__ = lazy_members(__name__, _EXPORTS, globals())
