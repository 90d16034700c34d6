"""The run, checkpoint, model and export folders as objects whose properties are their files' paths.

Outside ``ondisk`` and ``checkpoint``, code names a file of the layout through the folder it lives in:
``CheckpointFolder(ckpt).model.consolidated.config`` is a path, and ``HFFolder.adapter_config`` (on the class) is
that file's bare name, for a message or a member of an archive. ``layout`` still spells every name; these objects
only say where each one lives. A folder object is path-like (``os.fspath``, ``open``) and ``folder / "x"`` is a
``Path``."""

from __future__ import annotations

import os
from pathlib import Path

from automodel_ckpt.ondisk import layout as _L


class _Entry:
    """A file or folder of a folder object: its name on the class, its path (or folder object) on an instance."""

    def __init__(self, name: str, kind: type[Folder] | None = None) -> None:
        self.name, self.kind = name, kind

    def __get__(self, folder: Folder | None, owner: type | None = None):  # noqa: ANN204 (str on the class)
        if folder is None:
            return self.name
        path = folder.path / self.name
        return self.kind(path) if self.kind else path


class Folder:
    """A folder of the layout at ``path``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def __fspath__(self) -> str:
        return str(self.path)

    def __truediv__(self, other: str | os.PathLike[str]) -> Path:
        return self.path / other

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.path == self.path  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(self.path)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r})"

    def is_dir(self) -> bool:
        return self.path.is_dir()

    eval = _Entry(_L.EVAL_DIR)  # ``ckpt-train eval``'s results: one JSON per task

    def eval_results(self, task: str) -> Path:
        """``ckpt-train eval``'s results of ``task`` for this checkpoint or export."""
        return _L.eval_results_file(self.path, task)


class HFFolder(Folder):
    """A Hugging Face model or PEFT adapter folder: an export, a base model, a PEFT checkpoint's ``model/``."""

    config = _Entry(_L.HF_CONFIG)
    generation_config = _Entry(_L.HF_GENERATION_CONFIG)
    index = _Entry(_L.HF_INDEX)
    single_weights = _Entry(_L.HF_SINGLE_WEIGHTS)
    tokenizer_config = _Entry(_L.HF_TOKENIZER_CONFIG)
    adapter_config = _Entry(_L.ADAPTER_CONFIG)
    adapter_weights = _Entry(_L.ADAPTER_WEIGHTS)
    adapter_weights_pickle = _Entry(_L.ADAPTER_WEIGHTS_PICKLE)
    peft_full_config = _Entry(_L.PEFT_FULL_CONFIG)
    lineage = _Entry(_L.LINEAGE_FILE)  # the checkpoint(s) an export came from
    TOKENIZER_FILES = _L.HF_TOKENIZER_FILES

    @staticmethod
    def weights_name(index: int, total: int) -> str:
        """The name of weights file ``index`` (1-based) of ``total``."""
        return _L.hf_weights_file(index, total)

    def rank_done(self, rank: int) -> Path:
        """What a consolidation rank leaves in the export being written once its files are complete."""
        return self.path / _L.export_rank_marker(rank)

    def rank_failed(self, rank: int) -> Path:
        """What a consolidation rank leaves in the export being written when it failed (holds the message)."""
        return self.path / _L.export_rank_failure(rank)


class HFMetadata(HFFolder):
    """A model folder's hidden metadata: what its Hugging Face export needs besides the weights."""

    original_tensors = _Entry(_L.ORIGINAL_TENSORS_FILE)
    saved_state = _Entry(_L.SAVED_STATE_FILE)


class ModelFolder(HFFolder):
    """A checkpoint's ``model/`` (or ``ema/``): its shards, their metadata and the exports made from them."""

    hf_metadata = _Entry(_L.HF_METADATA_DIR, HFMetadata)
    consolidated = _Entry(_L.CONSOLIDATED_DIR, HFFolder)
    consolidated_ema = _Entry(_L.CONSOLIDATED_EMA_DIR, HFFolder)
    merged = _Entry(_L.MERGED_DIR, HFFolder)  # base + LoRA adapter (``ckpt-train merge-lora``)
    int8 = _Entry(_L.INT8_EXPORT_DIR, HFFolder)
    consolidate_script = _Entry(_L.CONSOLIDATE_SCRIPT)
    dcp_metadata = _Entry(_L.DCP_METADATA)

    @staticmethod
    def is_dcp_data_file(name: str) -> bool:
        return _L.is_dcp_data_file(name)


class CheckpointFolder(Folder):
    """One checkpoint: its counters, recipe, manifest, model and state."""

    VERSION = _L.LAYOUT_VERSION  # recorded in every checkpoint's metadata; bumped on incompatible changes
    metadata = _Entry(_L.METADATA_FILE)  # what identifies a folder as a checkpoint
    manifest = _Entry(_L.MANIFEST_FILE)
    config = _Entry(_L.CONFIG_FILE)
    losses = _Entry(_L.LOSSES_FILE)
    model = _Entry(_L.MODEL_DIR, ModelFolder)
    ema = _Entry(_L.EMA_DIR, ModelFolder)

    def state_file(self, attr: str) -> Path:
        """The file of a state object that is the same on every rank (``step_scheduler.pt``)."""
        return self.path / _L.global_state_file(attr)

    @property
    def archive(self) -> Path:
        """Where ``ckpt-train pack`` puts this checkpoint's archive by default: beside it."""
        return self.path.parent / f"{self.path.resolve().name}{_L.ARCHIVE_SUFFIX}"


class RunFolder(Folder):
    """A run folder (``checkpoint_dir``): its checkpoints, pointers, logs and trackers' default places."""

    latest = _Entry(_L.LATEST)
    lowest_val = _Entry(_L.LOWEST_VAL)
    best_eval = _Entry(_L.BEST_EVAL)
    training_log = _Entry(_L.TRAINING_LOG)
    validation_log = _Entry(_L.VALIDATION_LOG)
    events_log = _Entry(_L.EVENTS_LOG)
    report = _Entry(_L.REPORT_FILE)
    import_recipe = _Entry(_L.IMPORT_RECIPE)  # written by ``ckpt-train import``: the recipe that continues it
    quarantine = _Entry(_L.QUARANTINE_DIR)
    tensorboard = _Entry(_L.TENSORBOARD_DIR)
    mlflow_db = _Entry(_L.MLFLOW_DB)
    mlflow_db_new = _Entry(_L.MLFLOW_DB_NEW)
    mlflow_artifacts = _Entry(_L.MLFLOW_ARTIFACTS)
    mlflow_dir = _Entry(_L.MLFLOW_DIR)
    POINTERS = _L.POINTERS

    def checkpoint(self, name: str) -> CheckpointFolder:
        return CheckpointFolder(self.path / name)

    def ref_log_probs(self, key: str) -> Path:
        """A preference run's precomputed reference log-probs of the data and reference ``key`` names."""
        return _L.ref_log_probs_file(self.path, key)

    @staticmethod
    def is_staging(name: str) -> bool:
        return _L.is_staging(name)

    @staticmethod
    def parse_default_name(name: str) -> tuple[int, int] | None:
        """``(epoch, step)`` for a checkpoint name of the default template, else None."""
        return _L.parse_default_name(name)


class Archive(Folder):
    """A checkpoint's archive (``ckpt-train pack``, a ``.tar``); its members are names, not paths."""

    SUFFIX = _L.ARCHIVE_SUFFIX
    DIR = _L.ARCHIVE_DIR  # this project's members: the recipe, the metadata and the manifest (the last member)
    RECIPE = _L.ARCHIVE_RECIPE
    METADATA = _L.ARCHIVE_METADATA
    MANIFEST = _L.ARCHIVE_MANIFEST

    @property
    def eval(self) -> Path:  # type: ignore[override]
        """The folder beside the archive whose ``eval/`` holds its results: ``model.tar`` -> ``model.eval/``."""
        return _L.archive_eval_dir(self.path)

    def eval_results(self, task: str) -> Path:
        """``ckpt-train eval``'s results of ``task`` for the archive: ``model.eval/eval/<task>.json``."""
        return _L.eval_results_file(self.eval, task)


def tmp_sibling(path: str | os.PathLike[str], tag: str) -> Path:
    """The hidden sibling an export is written into before it is renamed to ``path``."""
    path = Path(path)
    return path.parent / _L.export_tmp_name(path.name, tag)


def old_sibling(path: str | os.PathLike[str], tag: str) -> Path:
    """The hidden sibling a previous export is moved to while the new one takes its place."""
    path = Path(path)
    return path.parent / _L.export_old_name(path.name, tag)
