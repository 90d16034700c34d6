"""The checkpoint layout's names that code outside ``ondisk`` and ``checkpoint`` reads: one table.

``LAYOUT`` holds ``layout``'s file and folder names and path builders that the verbs, the exports, evaluation,
interop, tracking and the recipes read (``LAYOUT.HF_CONFIG``, ``LAYOUT.model_dir(ckpt)``), each under its own
name: the spelling of a run folder and a checkpoint is one member of ``automodel_ckpt.ondisk``'s face, not one name
per file. A name that outside code starts to read is added here (``tests/unit/test_structure.py`` checks that each
is ``layout``'s own).
"""

from __future__ import annotations

from types import SimpleNamespace

from automodel_ckpt.ondisk import layout

_NAMES = (
    "LAYOUT_VERSION",
    # a run folder: pointers, logs, trackers' default places, quarantine, an import's recipe
    "LATEST LOWEST_VAL BEST_EVAL TRAINING_LOG VALIDATION_LOG IMPORT_RECIPE EVENTS_LOG TENSORBOARD_DIR MLFLOW_DB "
    "MLFLOW_DB_NEW MLFLOW_ARTIFACTS MLFLOW_DIR QUARANTINE_DIR REPORT_FILE",
    # a checkpoint folder
    "METADATA_FILE MANIFEST_FILE CONFIG_FILE MODEL_DIR CONSOLIDATED_DIR EMA_DIR CONSOLIDATE_SCRIPT EVAL_DIR "
    "EVAL_SUFFIX DCP_METADATA MERGED_DIR INT8_EXPORT_DIR LINEAGE_FILE",
    # a model folder's hidden Hugging Face metadata (what its export needs besides the weights)
    "HF_METADATA_DIR ORIGINAL_TENSORS_FILE SAVED_STATE_FILE",
    # a Hugging Face folder and a PEFT adapter
    "HF_CONFIG HF_GENERATION_CONFIG HF_INDEX HF_SINGLE_WEIGHTS HF_TOKENIZER_FILES HF_TOKENIZER_CONFIG ADAPTER_CONFIG "
    "ADAPTER_WEIGHTS ADAPTER_WEIGHTS_PICKLE PEFT_FULL_CONFIG",
    # an archive beside a checkpoint, and its own members
    "ARCHIVE_SUFFIX ARCHIVE_DIR ARCHIVE_MANIFEST ARCHIVE_METADATA ARCHIVE_RECIPE",
    # path builders
    "archive_eval_dir consolidated_dir consolidated_ema_dir ema_dir eval_results_file export_tmp_name "
    "global_state_file hf_metadata_dir hf_weights_file is_staging model_dir parse_default_name ref_log_probs_file "
    "export_old_name export_rank_failure export_rank_marker is_dcp_data_file",
)

# ``layout``'s names read outside ``ondisk`` and ``checkpoint`` (``layout.py`` says what each names): LAYOUT.NAME
LAYOUT = SimpleNamespace(**{name: getattr(layout, name) for group in _NAMES for name in group.split()})
