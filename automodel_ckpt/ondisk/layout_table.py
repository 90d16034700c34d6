"""The checkpoint layout's names that code outside ``ondisk``, ``export`` and ``checkpoint`` reads: one table.

``LAYOUT`` holds ``layout``'s file and folder names and path builders that the verbs, evaluation, interop, tracking
and the recipes read (``LAYOUT.HF_CONFIG``, ``LAYOUT.model_dir(ckpt)``), each under its own name: the spelling of a
run folder and a checkpoint is one member of ``automodel_ckpt.ondisk``'s face, not one name per file. A name that
outside code starts to read is added here (``tests/unit/test_structure.py`` checks that each is ``layout``'s own).
"""

from __future__ import annotations

from automodel_ckpt.ondisk import layout


class LAYOUT:  # noqa: N801 - a table of constants, read as LAYOUT.NAME
    """``layout``'s names read outside the three packages (``layout.py`` says what each names)."""

    # the version of the layout
    LAYOUT_VERSION = layout.LAYOUT_VERSION
    # a run folder: pointers, logs, trackers' default places, quarantine, an import's recipe
    LATEST = layout.LATEST
    LOWEST_VAL = layout.LOWEST_VAL
    BEST_EVAL = layout.BEST_EVAL
    TRAINING_LOG = layout.TRAINING_LOG
    VALIDATION_LOG = layout.VALIDATION_LOG
    IMPORT_RECIPE = layout.IMPORT_RECIPE
    EVENTS_LOG = layout.EVENTS_LOG
    TENSORBOARD_DIR = layout.TENSORBOARD_DIR
    MLFLOW_DB = layout.MLFLOW_DB
    MLFLOW_DB_NEW = layout.MLFLOW_DB_NEW
    MLFLOW_ARTIFACTS = layout.MLFLOW_ARTIFACTS
    MLFLOW_DIR = layout.MLFLOW_DIR
    QUARANTINE_DIR = layout.QUARANTINE_DIR
    # a checkpoint folder
    METADATA_FILE = layout.METADATA_FILE
    MANIFEST_FILE = layout.MANIFEST_FILE
    CONFIG_FILE = layout.CONFIG_FILE
    MODEL_DIR = layout.MODEL_DIR
    CONSOLIDATED_DIR = layout.CONSOLIDATED_DIR
    EMA_DIR = layout.EMA_DIR
    CONSOLIDATE_SCRIPT = layout.CONSOLIDATE_SCRIPT
    EVAL_DIR = layout.EVAL_DIR
    EVAL_SUFFIX = layout.EVAL_SUFFIX
    # a Hugging Face folder and a PEFT adapter
    HF_CONFIG = layout.HF_CONFIG
    HF_GENERATION_CONFIG = layout.HF_GENERATION_CONFIG
    HF_INDEX = layout.HF_INDEX
    HF_SINGLE_WEIGHTS = layout.HF_SINGLE_WEIGHTS
    HF_TOKENIZER_FILES = layout.HF_TOKENIZER_FILES
    ADAPTER_CONFIG = layout.ADAPTER_CONFIG
    ADAPTER_WEIGHTS = layout.ADAPTER_WEIGHTS
    PEFT_FULL_CONFIG = layout.PEFT_FULL_CONFIG
    # exports beside a checkpoint
    ARCHIVE_SUFFIX = layout.ARCHIVE_SUFFIX
    GGUF_SUFFIX = layout.GGUF_SUFFIX
    INT8_EXPORT_DIR = layout.INT8_EXPORT_DIR
    # path builders
    archive_eval_dir = staticmethod(layout.archive_eval_dir)
    consolidated_dir = staticmethod(layout.consolidated_dir)
    consolidated_ema_dir = staticmethod(layout.consolidated_ema_dir)
    ema_dir = staticmethod(layout.ema_dir)
    eval_results_file = staticmethod(layout.eval_results_file)
    export_tmp_name = staticmethod(layout.export_tmp_name)
    global_state_file = staticmethod(layout.global_state_file)
    hf_metadata_dir = staticmethod(layout.hf_metadata_dir)
    hf_weights_file = staticmethod(layout.hf_weights_file)
    is_staging = staticmethod(layout.is_staging)
    model_dir = staticmethod(layout.model_dir)
    parse_default_name = staticmethod(layout.parse_default_name)
    ref_log_probs_file = staticmethod(layout.ref_log_probs_file)
