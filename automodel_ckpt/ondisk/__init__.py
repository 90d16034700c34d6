"""The checkpoint folder and its bytes: the contract with every checkpoint on disk, and its one public face.

Everything a checkpoint folder holds is spelled and read here, versioned by ``layout.LAYOUT_VERSION``: file names
(``layout``), limits on untrusted files (``bounded``), the path validator (``paths``), metadata, the manifest and
its checksums, durable writes, the catalog of a run folder, the byte formats (``formats/``: sharded model and
optimizer state, PEFT adapters, safetensors, the only reader of pickles), the engine that moves their bytes
(``fastio/``: parallel file I/O) and the planning of DCP saves (``saveplan/``). It never imports the
exports (``automodel_ckpt.export``) nor the engine that writes checkpoints (``automodel_ckpt.checkpoint``).

Code outside this package, ``export`` and ``checkpoint`` imports only the names below, each a member of a module here
under its own name, never a whole module (``tests/unit/test_structure.py``): what that code reads, nothing more. The
layout's file names and path builders are one of them, the table ``LAYOUT`` (``LAYOUT.HF_CONFIG``). The modules
inside are private to the three packages (benchmarks that time them aside, each saying so). The names load on first
use, so reading a run folder (``inspect``, ``verify``) imports no torch.
"""

from __future__ import annotations

from automodel_ckpt.faces import exports_of, lazy_members

# module below this package -> the names of its members that the face hands on
_EXPORTS = exports_of({
    "layout_table": "LAYOUT",  # the file and folder names of a run folder and a checkpoint, and their path builders
    "bounded": "CONFIG_FILE_LIMIT INDEX_FILE_LIMIT LOG_FILE_LIMIT LOG_LINE_LIMIT MAX_DEPTH SMALL_FILE_LIMIT MiB "
               "check_size is_count parse_json read_bytes read_json read_yaml yaml_depth_line",
    "paths": "check_path file_kind is_plain_name model_file_in open_regular path_inside regular_file_problem",
    "catalog": "CheckpointRecord list_checkpoints pointer_target pointer_targets quarantined_checkpoints "
               "scan_checkpoints size_on_disk",
    "manifest": "CHECKSUM_MISMATCH UNEXPECTED_FILE ManifestReport add_files_to_manifest read_manifest verify_manifest",
    "metadata": "as_float",
    "fingerprint": "run_fingerprint",
    "incremental": "shared_bytes stored_once",  # checkpoint.incremental: own / shared bytes of a checkpoint
    "durable": "write_atomic fsync_file",
    "formats.detect": "detect_model_format",
    "formats.safe_load": "load_pt",
    "formats.dcp_folder": "read_dcp_folder",
})

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_members(__name__, _EXPORTS, globals())
