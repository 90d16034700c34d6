"""The checkpoint folder and its bytes: the contract with every checkpoint on disk, and its one public face.

Everything a checkpoint folder holds is spelled and read here, versioned by ``layout.LAYOUT_VERSION``: file names
(``layout``), limits on untrusted files (``bounded``), the path validator (``paths``), metadata, the manifest and
its checksums, durable writes, the catalog of a run folder, the byte formats (``formats/``: sharded model and
optimizer state, PEFT adapters, safetensors, the only reader of pickles, parallel file I/O). It never imports the
exports (``automodel_ckpt.export``) nor the engine that writes checkpoints (``automodel_ckpt.checkpoint``).

Code outside this package, ``export`` and ``checkpoint`` imports only the names below, each a member of a module here,
never a whole module (``tests/unit/test_structure.py``); the modules inside are private to the three. A few members
are renamed where their own name is too general out of context (``read_manifest``, ``scan_checkpoints``,
``CONFIG_FILE_LIMIT``). The names load on first use, so reading a run folder
(``inspect``, ``verify``) imports no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> (module below this package, its name there)
_EXPORTS = {
    # file and folder names of a checkpoint and a run folder (layout)
    "ADAPTER_CONFIG": ("layout", "ADAPTER_CONFIG"),
    "ADAPTER_WEIGHTS": ("layout", "ADAPTER_WEIGHTS"),
    "ARCHIVE_SUFFIX": ("layout", "ARCHIVE_SUFFIX"),
    "BEST_EVAL": ("layout", "BEST_EVAL"),
    "CONFIG_FILE": ("layout", "CONFIG_FILE"),
    "CONSOLIDATE_SCRIPT": ("layout", "CONSOLIDATE_SCRIPT"),
    "CONSOLIDATED_DIR": ("layout", "CONSOLIDATED_DIR"),
    "EMA_DIR": ("layout", "EMA_DIR"),
    "EVAL_DIR": ("layout", "EVAL_DIR"),
    "EVAL_SUFFIX": ("layout", "EVAL_SUFFIX"),
    "EVENTS_LOG": ("layout", "EVENTS_LOG"),
    "GGUF_SUFFIX": ("layout", "GGUF_SUFFIX"),
    "HF_CONFIG": ("layout", "HF_CONFIG"),
    "HF_GENERATION_CONFIG": ("layout", "HF_GENERATION_CONFIG"),
    "HF_INDEX": ("layout", "HF_INDEX"),
    "HF_SINGLE_WEIGHTS": ("layout", "HF_SINGLE_WEIGHTS"),
    "HF_TOKENIZER_FILES": ("layout", "HF_TOKENIZER_FILES"),
    "IMPORT_RECIPE": ("layout", "IMPORT_RECIPE"),
    "INT8_EXPORT_DIR": ("layout", "INT8_EXPORT_DIR"),
    "LATEST": ("layout", "LATEST"),
    "LAYOUT_VERSION": ("layout", "LAYOUT_VERSION"),
    "LOWEST_VAL": ("layout", "LOWEST_VAL"),
    "MANIFEST_FILE": ("layout", "MANIFEST_FILE"),
    "METADATA_FILE": ("layout", "METADATA_FILE"),
    "MLFLOW_ARTIFACTS": ("layout", "MLFLOW_ARTIFACTS"),
    "MLFLOW_DB": ("layout", "MLFLOW_DB"),
    "MLFLOW_DB_NEW": ("layout", "MLFLOW_DB_NEW"),
    "MLFLOW_DIR": ("layout", "MLFLOW_DIR"),
    "MODEL_DIR": ("layout", "MODEL_DIR"),
    "PEFT_FULL_CONFIG": ("layout", "PEFT_FULL_CONFIG"),
    "QUARANTINE_DIR": ("layout", "QUARANTINE_DIR"),
    "TENSORBOARD_DIR": ("layout", "TENSORBOARD_DIR"),
    "TRAINING_LOG": ("layout", "TRAINING_LOG"),
    "VALIDATION_LOG": ("layout", "VALIDATION_LOG"),
    "archive_eval_dir": ("layout", "archive_eval_dir"),
    "consolidated_dir": ("layout", "consolidated_dir"),
    "consolidated_ema_dir": ("layout", "consolidated_ema_dir"),
    "ema_dir": ("layout", "ema_dir"),
    "eval_results_file": ("layout", "eval_results_file"),
    "export_tmp_name": ("layout", "export_tmp_name"),
    "global_state_file": ("layout", "global_state_file"),
    "hf_metadata_dir": ("layout", "hf_metadata_dir"),
    "hf_weights_file": ("layout", "hf_weights_file"),
    "is_staging": ("layout", "is_staging"),
    "model_dir": ("layout", "model_dir"),
    "model_shard_file": ("layout", "model_shard_file"),
    "parse_default_name": ("layout", "parse_default_name"),
    "ref_log_probs_file": ("layout", "ref_log_probs_file"),
    # limits on untrusted files and the bounded readers (bounded)
    "CONFIG_FILE_LIMIT": ("bounded", "CONFIG_FILE"),
    "INDEX_FILE_LIMIT": ("bounded", "INDEX_FILE"),
    "LOG_FILE_LIMIT": ("bounded", "LOG_FILE"),
    "LOG_LINE_LIMIT": ("bounded", "LOG_LINE"),
    "MAX_DEPTH": ("bounded", "MAX_DEPTH"),
    "SMALL_FILE_LIMIT": ("bounded", "SMALL_FILE"),
    "MiB": ("bounded", "MiB"),
    "check_size": ("bounded", "check_size"),
    "parse_json": ("bounded", "parse_json"),
    "read_bytes": ("bounded", "read_bytes"),
    "read_json": ("bounded", "read_json"),
    "read_yaml": ("bounded", "read_yaml"),
    "yaml_depth_line": ("bounded", "yaml_depth_line"),
    # path checks on names read from files (paths)
    "check_path": ("paths", "check"),
    "file_kind": ("paths", "kind"),
    "is_plain_name": ("paths", "is_plain_name"),
    "model_file_in": ("paths", "model_file"),
    "open_regular": ("paths", "open_regular"),
    "path_inside": ("paths", "inside"),
    "regular_file_problem": ("paths", "regular_file_problem"),
    # the catalog of a run folder: its checkpoints and pointers (catalog)
    "CheckpointRecord": ("catalog", "CheckpointRecord"),
    "list_checkpoints": ("catalog", "list_checkpoints"),
    "pointer_target": ("catalog", "pointer_target"),
    "pointer_targets": ("catalog", "pointer_targets"),
    "quarantined_checkpoints": ("catalog", "quarantined"),
    "scan_checkpoints": ("catalog", "scan"),
    "size_on_disk": ("catalog", "size_on_disk"),
    # the manifest: files, checksums, verification (manifest)
    "CHECKSUM_MISMATCH": ("manifest", "CHECKSUM_MISMATCH"),
    "UNEXPECTED_FILE": ("manifest", "UNEXPECTED"),
    "ManifestReport": ("manifest", "Report"),
    "add_files_to_manifest": ("manifest", "add_files"),
    "build_manifest": ("manifest", "build"),
    "dump_manifest": ("manifest", "dumps"),
    "list_checkpoint_files": ("manifest", "list_files"),
    "merge_checksums": ("manifest", "merge_checksums"),
    "read_manifest": ("manifest", "read"),
    "verify_manifest": ("manifest", "verify"),
    # save and load planning (formats.planning: what tools/bench_scale.py simulates)
    "LinearSavePlanner": ("formats.planning", "LinearSavePlanner"),
    "LocalLoadPlanner": ("formats.planning", "LocalLoadPlanner"),
    "clear_plan_cache": ("formats.planning", "clear_cache"),
    "read_items_for_chunks": ("formats.planning", "read_items_for_chunks"),
    # the write results' cache across saves (formats.plan_results)
    "ResultsNote": ("formats.plan_results", "ResultsNote"),
    "clear_results_cache": ("formats.plan_results", "clear_cache"),
    "incoming_results": ("formats.plan_results", "incoming"),
    "outgoing_results": ("formats.plan_results", "outgoing"),
    "results_succeeded": ("formats.plan_results", "succeeded"),
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
    "WRITE_THREADS": ("formats.fastio", "WRITE_THREADS"),
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from automodel_ckpt.ondisk.bounded import (MAX_DEPTH, MiB, check_size, parse_json, read_bytes, read_json, read_yaml,
                                               yaml_depth_line)
    from automodel_ckpt.ondisk.bounded import CONFIG_FILE as CONFIG_FILE_LIMIT
    from automodel_ckpt.ondisk.bounded import INDEX_FILE as INDEX_FILE_LIMIT
    from automodel_ckpt.ondisk.bounded import LOG_FILE as LOG_FILE_LIMIT
    from automodel_ckpt.ondisk.bounded import LOG_LINE as LOG_LINE_LIMIT
    from automodel_ckpt.ondisk.bounded import SMALL_FILE as SMALL_FILE_LIMIT
    from automodel_ckpt.ondisk.catalog import (CheckpointRecord, list_checkpoints, pointer_target, pointer_targets,
                                               size_on_disk)
    from automodel_ckpt.ondisk.catalog import quarantined as quarantined_checkpoints
    from automodel_ckpt.ondisk.catalog import scan as scan_checkpoints
    from automodel_ckpt.ondisk.durable import fsync_file, write_atomic
    from automodel_ckpt.ondisk.fingerprint import run_fingerprint
    from automodel_ckpt.ondisk.formats.dcp_folder import read_dcp_folder
    from automodel_ckpt.ondisk.formats.detect import detect_model_format
    from automodel_ckpt.ondisk.formats.fastio import READ_THREADS, WRITE_THREADS
    from automodel_ckpt.ondisk.formats.plan_results import ResultsNote
    from automodel_ckpt.ondisk.formats.plan_results import clear_cache as clear_results_cache
    from automodel_ckpt.ondisk.formats.plan_results import incoming as incoming_results
    from automodel_ckpt.ondisk.formats.plan_results import outgoing as outgoing_results
    from automodel_ckpt.ondisk.formats.plan_results import succeeded as results_succeeded
    from automodel_ckpt.ondisk.formats.planning import LinearSavePlanner, LocalLoadPlanner, read_items_for_chunks
    from automodel_ckpt.ondisk.formats.planning import clear_cache as clear_plan_cache
    from automodel_ckpt.ondisk.formats.safe_load import load_pt
    from automodel_ckpt.ondisk.incremental import shared_bytes, stored_once
    from automodel_ckpt.ondisk.info import HFArtifacts, SaveInfo, WrittenBy
    from automodel_ckpt.ondisk.layout import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, ARCHIVE_SUFFIX, BEST_EVAL, CONFIG_FILE,
                                              CONSOLIDATE_SCRIPT, CONSOLIDATED_DIR, EMA_DIR, EVAL_DIR, EVAL_SUFFIX,
                                              EVENTS_LOG, GGUF_SUFFIX, HF_CONFIG, HF_GENERATION_CONFIG, HF_INDEX,
                                              HF_SINGLE_WEIGHTS, HF_TOKENIZER_FILES, IMPORT_RECIPE, INT8_EXPORT_DIR,
                                              LATEST,
                                              LAYOUT_VERSION, LOWEST_VAL, MANIFEST_FILE, METADATA_FILE,
                                              MLFLOW_ARTIFACTS, MLFLOW_DB, MLFLOW_DB_NEW, MLFLOW_DIR, MODEL_DIR,
                                              PEFT_FULL_CONFIG, QUARANTINE_DIR, TENSORBOARD_DIR, TRAINING_LOG,
                                              VALIDATION_LOG, archive_eval_dir, consolidated_dir, consolidated_ema_dir,
                                              ema_dir, eval_results_file, export_tmp_name, global_state_file,
                                              hf_metadata_dir, hf_weights_file, is_staging, model_dir, model_shard_file,
                                              parse_default_name, ref_log_probs_file)
    from automodel_ckpt.ondisk.manifest import CHECKSUM_MISMATCH, merge_checksums
    from automodel_ckpt.ondisk.manifest import Report as ManifestReport
    from automodel_ckpt.ondisk.manifest import UNEXPECTED as UNEXPECTED_FILE
    from automodel_ckpt.ondisk.manifest import add_files as add_files_to_manifest
    from automodel_ckpt.ondisk.manifest import build as build_manifest
    from automodel_ckpt.ondisk.manifest import dumps as dump_manifest
    from automodel_ckpt.ondisk.manifest import list_files as list_checkpoint_files
    from automodel_ckpt.ondisk.manifest import read as read_manifest
    from automodel_ckpt.ondisk.manifest import verify as verify_manifest
    from automodel_ckpt.ondisk.metadata import as_float, written_by
    from automodel_ckpt.ondisk.paths import is_plain_name, open_regular, regular_file_problem
    from automodel_ckpt.ondisk.paths import check as check_path
    from automodel_ckpt.ondisk.paths import inside as path_inside
    from automodel_ckpt.ondisk.paths import kind as file_kind
    from automodel_ckpt.ondisk.paths import model_file as model_file_in


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = _EXPORTS[name]
    loaded = importlib.import_module(f"{__name__}.{module}")
    value = loaded if attr is None else getattr(loaded, attr)
    globals()[name] = value
    return value
