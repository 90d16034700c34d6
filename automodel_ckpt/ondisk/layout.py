"""Every on-disk name of a checkpoint directory, in one place.

docs/checkpointing.md ("Every name") maps each name below to its place in a run folder, a checkpoint, an object
store, a node-local folder and an archive."""

from __future__ import annotations

import re
import string
from pathlib import Path

from automodel_ckpt.errors import ConfigError

# --- checkpoint_dir level -------------------------------------------------------------------------
LATEST = "LATEST"
LOWEST_VAL = "LOWEST_VAL"
BEST_EVAL = "BEST_EVAL"  # LOWEST_VAL's place when checkpoint.monitor is an eval score (evaluation during training)
POINTERS = (LATEST, LOWEST_VAL, BEST_EVAL)
TRAINING_LOG = "training.jsonl"
VALIDATION_LOG = "validation.jsonl"
REPORT_FILE = "report.html"  # ckpt-train report's page; rewritten at each checkpoint with logging.report
EVENTS_LOG = "events.jsonl"  # each launch, each save's cost, each end: appended, never truncated (tracking/costlog.py)
TENSORBOARD_DIR = "tensorboard"  # logging.tensorboard's event files when log_dir is not set
MLFLOW_DB = "mlflow.db"  # logging.mlflow's SQLite store when tracking_uri is not set
MLFLOW_DB_NEW = ".mlflow.db.new"  # that store while MLflow creates its tables; renamed to MLFLOW_DB when done
MLFLOW_ARTIFACTS = "mlartifacts"  # that store's artifact root
MLFLOW_DIR = "mlruns"  # the file store of earlier versions' default: continued where a run folder has one
WANDB_DIR = "wandb"  # what Weights & Biases writes below logging.wandb.dir (default: the run folder)
STAGING_PREFIX = ".staging-"
DELETING_PREFIX = ".deleting-"
QUARANTINE_DIR = "quarantine"  # damaged checkpoints moved aside by resume (never listed, never pointed at)
OBJECT_STORE_SOURCE = ".object-store.json"  # in a local mirror of an object-store checkpoint_dir: its URL
# On an object store: the run folder's marker, a checkpoint upload's first object, the lease of the writing run.
RUN_MARKER = ".automodel-ckpt-run.json"
LINEAGE_FILE = "automodel_lineage.json"  # in an export folder: the checkpoint(s) it came from (lineage.py)
IMPORT_RECIPE = "recipe.yaml"  # in a run folder written by ``ckpt-train import``: the recipe that continues it
UPLOAD_MARKER = ".automodel-ckpt-upload.json"
LEASE_OBJECT = ".automodel-ckpt-lease.json"
PIECES_DIR = ".automodel-ckpt-pieces"  # object store: the run's stable files stored once, by content key
PIECE_REFS = "pieces.json"  # object store: in a checkpoint's prefix, its files stored as pieces (file -> key)
REF_LOG_PROBS_DIR = "ref_log_probs"  # precomputed reference log-probs of a preference run (dpo.precompute_ref_log_probs)
RUN_LOCK = ".run.lock"  # flock'ed by the run that owns the folder; host, pid, start time (storage/runlock.py)
# --- a node-local folder (checkpoint.local) ---------------------------------------------------------------
LOCAL_BINDING = ".automodel-ckpt-local.json"  # the run a node-local folder belongs to (nodelocal/localdir.py)
LOCAL_DEFAULT_BASE = "/dev/shm"  # where the per-user parent of the default node-local folders is made
LOCAL_USER_PREFIX = "automodel-ckpt-"  # the per-user parent: automodel-ckpt-<user>
DEFAULT_NAME_TEMPLATE = "epoch_{epoch}_step_{step}"
# Fields a checkpoint.name_template may use; a field whose value is unknown (no validation yet) renders as "none".
NAME_TEMPLATE_FIELDS = ("epoch", "step", "consumed_samples", "train_loss", "val_loss")
_DEFAULT_NAME_RE = re.compile(r"^epoch_(\d+)_step_(\d+)$")

# --- inside one checkpoint ------------------------------------------------------------------------
METADATA_FILE = "metadata.json"  # counters, losses, versions: what identifies a folder as a checkpoint
# Version of this layout, recorded in every checkpoint's metadata; bumped on incompatible on-disk changes.
LAYOUT_VERSION = 1
MANIFEST_FILE = "manifest.json"  # size + checksum of every file of the checkpoint (docs/integrity.md)
CONFIG_FILE = "config.yaml"
LOSSES_FILE = "losses.json"

MODEL_DIR = "model"
OPTIM_DIR = "optim"
CONSOLIDATED_DIR = "consolidated"
EMA_DIR = "ema"  # the recipe's ``ema`` state (training.ema_decay): its attribute name is its folder name
CONSOLIDATED_EMA_DIR = "consolidated_ema"  # the EMA weights as a Hugging Face folder, beside consolidated/
MERGED_DIR = "merged"  # base + LoRA adapter merged into a full HF model (PEFT checkpoints)
CONSOLIDATE_SCRIPT = "consolidate.sh"
HF_METADATA_DIR = ".hf_metadata"
ORIGINAL_TENSORS_FILE = "original_tensors.json"
SAVED_STATE_FILE = "saved_state.json"
DCP_METADATA = ".metadata"
# What a mirror of an object-store checkpoint keeps until the checkpoint is loaded: enough to list and select it
# (the manifest, the commit object, last).
CATALOG_FILES = (METADATA_FILE, CONFIG_FILE, LOSSES_FILE, f"{MODEL_DIR}/{HF_METADATA_DIR}/config.json", MANIFEST_FILE)

# --- Hugging Face names -----------------------------------------------------------------------------
HF_INDEX = "model.safetensors.index.json"
HF_SINGLE_WEIGHTS = "model.safetensors"
HF_CONFIG = "config.json"
HF_GENERATION_CONFIG = "generation_config.json"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_WEIGHTS_PICKLE = "adapter_model.bin"  # older PEFT adapters: read by PEFT when no safetensors file exists
HF_TOKENIZER_CONFIG = "tokenizer_config.json"
PEFT_FULL_CONFIG = "automodel_peft_config.json"
# --- an archive (`ckpt-train pack`): a Hugging Face or adapter folder's files, and this project's in a folder ----
ARCHIVE_DIR = "automodel"
ARCHIVE_RECIPE = f"{ARCHIVE_DIR}/{CONFIG_FILE}"  # the checkpoint's config.yaml (redacted)
ARCHIVE_METADATA = f"{ARCHIVE_DIR}/{METADATA_FILE}"  # the checkpoint's metadata.json
ARCHIVE_MANIFEST = f"{ARCHIVE_DIR}/{MANIFEST_FILE}"  # every other member's size and checksum; the last member
ARCHIVE_SUFFIX = ".tar"
# --- quantized exports (`ckpt-train export --to int8`; each file target names its own suffix) -----------------------
INT8_EXPORT_DIR = "int8"  # default folder name of an int8 export, beside the checkpoint's consolidated/
# --- `ckpt-train eval` -----------------------------------------------------------------------------------------
EVAL_DIR = "eval"  # the harness's results JSON of each task, in the checkpoint or folder evaluated
EVAL_SUFFIX = ".json"
# Tokenizer (and image-text processor) files a Hugging Face model folder may hold (copied from a base folder when
# no tokenizer is given).
HF_TOKENIZER_FILES = (
    "processor_config.json",
    "preprocessor_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)

# Discovered state attributes whose folder name differs from the attribute name.
_STATE_DIR_NAMES = {"optimizer": OPTIM_DIR}


def ref_log_probs_file(run_dir: Path, key: str) -> Path:
    """The precomputed reference log-probs of the data and reference ``key`` names, in a run folder."""
    return Path(run_dir) / REF_LOG_PROBS_DIR / f"{key}.pt"


def best_pointer(monitor: str) -> str:
    """The pointer naming the best checkpoint by ``checkpoint.monitor``: ``BEST_EVAL`` for an eval score
    (``eval/<task>/<metric>``), else ``LOWEST_VAL``."""
    return BEST_EVAL if str(monitor).startswith("eval/") else LOWEST_VAL


def pointer_text_file(pointer: str) -> str:
    """Fallback file holding a pointer's target name on filesystems without symlinks."""
    return f"{pointer}.txt"


class _NameFormatter(string.Formatter):
    """``str.format`` that renders a missing value (None) as ``none`` whatever its format spec."""

    def format_field(self, value: object, format_spec: str) -> str:
        return "none" if value is None else super().format_field(value, format_spec)


def checkpoint_name(epoch: int, step: int, template: str = DEFAULT_NAME_TEMPLATE, **fields: object) -> str:
    """Folder name of the checkpoint taken after ``step`` optimizer steps in ``epoch``."""
    return _NameFormatter().format(template, epoch=epoch, step=step, **fields)


# Names at the checkpoint_dir level that a rendered checkpoint name must never take.
RESERVED_NAMES = frozenset({*POINTERS, *(pointer_text_file(p) for p in POINTERS), TRAINING_LOG, VALIDATION_LOG,
                            QUARANTINE_DIR, REF_LOG_PROBS_DIR})
# The longest file name most filesystems accept is 255 bytes; a checkpoint name also goes behind a prefix.
MAX_NAME_BYTES = 255 - max(len(STAGING_PREFIX), len(DELETING_PREFIX))


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a checkpoint folder in checkpoint_dir (None: it can): one folder level, not hidden,
    not a name the folder already uses for something else, short enough for the filesystem."""
    if not name:
        return "it is empty"
    if "/" in name or "\\" in name or "\0" in name:
        return "it contains a path separator or NUL"
    if name.startswith("."):
        return "it starts with a dot (hidden and staging names)"
    if name in RESERVED_NAMES:
        return "it is a name the checkpoint folder uses for something else"
    if len(name.encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES:
        return f"it is longer than {MAX_NAME_BYTES} bytes"
    return None


def name_template_fields(template: str) -> list[str]:
    """The field names a name template uses, in order (``ValueError`` for malformed braces)."""
    return [field for _, field, _, _ in string.Formatter().parse(template) if field is not None]


# Values the template is tried with at start: the shortest and some long ones (a fill character shows at short
# values), unknown losses, and a step that sets a nested width. Every save renders its name through
# ``render_name`` again: a value met only at run time is refused then, before anything is created.
_SAMPLE_FIELDS = (
    {"epoch": 0, "step": 1, "consumed_samples": 64, "train_loss": 1.5, "val_loss": 1.25},
    {"epoch": 0, "step": 1, "consumed_samples": 64, "train_loss": None, "val_loss": None},
    {"epoch": 0, "step": 0, "consumed_samples": 0, "train_loss": 0.0, "val_loss": 0.0},
    {"epoch": 12, "step": 123456, "consumed_samples": 98765432, "train_loss": -12.75, "val_loss": float("nan")},
)
_KEY = "checkpoint.name_template"


def check_name_template(template: str) -> None:
    """A template must use known fields, contain ``{step}`` and render a plain folder name."""
    try:
        fields = name_template_fields(template)
    except ValueError as exc:
        raise ConfigError(f"{_KEY}: malformed template '{template}': {exc}") from None
    unknown = [f for f in fields if f not in NAME_TEMPLATE_FIELDS]
    if unknown:
        raise ConfigError(
            f"{_KEY}: unknown field '{{{unknown[0]}}}' in '{template}'; "
            f"available: {', '.join('{' + f + '}' for f in NAME_TEMPLATE_FIELDS)}"
        )
    if "step" not in fields:
        raise ConfigError(f"{_KEY}: '{template}' must contain {{step}} so that every checkpoint gets its own folder")
    for sample in _SAMPLE_FIELDS:
        render_name(template, when="with sample values", **sample)  # type: ignore[arg-type]


def render_name(template: str, epoch: int, step: int, *, when: str | None = None, **fields: object) -> str:
    """The checkpoint folder name ``template`` gives these values; ``ConfigError`` (one line naming the template and
    what it rendered) when that is not a usable folder name (``name_problem``). Called for every save."""
    when = when or f"at step {step}"
    try:
        name = checkpoint_name(epoch, step, template, **fields)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
        raise ConfigError(f"{_KEY}: cannot render '{template}' {when}: {exc}") from None
    problem = name_problem(name)
    if problem:
        raise ConfigError(
            f"{_KEY}: '{template}' renders {name!r} {when}, which is not a usable folder name ({problem}); "
            "use a template without fill characters or path separators, e.g. 'epoch_{epoch}_step_{step}'"
        )
    return name


def local_user_dir(user: str) -> str:
    """The per-user parent of the default node-local folders: ``automodel-ckpt-<user>``."""
    return f"{LOCAL_USER_PREFIX}{user}"


def received_tmp_name(final_name: str, tag: str) -> str:
    """Hidden sibling a file received from another rank is written into before it is renamed to its name."""
    return f".{final_name}.recv-{tag}"


def quarantine_note(name: str) -> str:
    """File beside a quarantined checkpoint folder that records why it was moved there."""
    return f"{name}.json"


def deleting_name(name: str) -> str:
    return DELETING_PREFIX + name


def parse_default_name(name: str) -> tuple[int, int] | None:
    """``(epoch, step)`` for a name of the default template, else None."""
    m = _DEFAULT_NAME_RE.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def staging_name(name: str) -> str:
    return STAGING_PREFIX + name


def is_staging(name: str) -> bool:
    return name.startswith(STAGING_PREFIX)


def state_dir(attr: str) -> str:
    """Folder of a sharded (DCP) state object, e.g. ``optimizer`` -> ``optim``."""
    return _STATE_DIR_NAMES.get(attr, attr)


def global_state_file(attr: str) -> str:
    """File of a state object that is the same on every rank, e.g. ``step_scheduler.pt``."""
    return f"{attr}.pt"


def rank_state_file(attr: str, rank: int) -> str:
    """Per-rank file, relative to the checkpoint: ``dataloader/dataloader_dp_rank_0.pt``."""
    return f"{attr}/{attr}_dp_rank_{rank}.pt"


_RANK_FILE_RE = re.compile(r"^(?P<attr>.+)_dp_rank_(?P<rank>\d+)\.pt$")


def parse_rank_state_file(filename: str) -> tuple[str, int] | None:
    m = _RANK_FILE_RE.match(filename)
    return (m.group("attr"), int(m.group("rank"))) if m else None


def model_shard_file(rank: int, index: int, total: int) -> str:
    """Per-rank safetensors shard as written by torch's HuggingFaceStorageWriter (rank is 0-based)."""
    return f"shard-{rank + 1:05d}-model-{index:05d}-of-{total:05d}.safetensors"


_SHARD_RE = re.compile(r"^shard-(\d{5})-model-(\d{5})-of-(\d{5})\.safetensors$")


def parse_model_shard_file(filename: str) -> tuple[int, int, int] | None:
    """``(rank, index, total)`` for a shard file name (rank 0-based), else None."""
    m = _SHARD_RE.match(filename)
    return (int(m.group(1)) - 1, int(m.group(2)), int(m.group(3))) if m else None


def hf_weights_file(index: int, total: int) -> str:
    return f"model-{index:05d}-of-{total:05d}.safetensors"


def export_tmp_name(final_name: str, tag: str) -> str:
    """Hidden sibling an export is written into before it is renamed to ``final_name``."""
    return f".{final_name}.tmp-{tag}"


def export_old_name(final_name: str, tag: str) -> str:
    """Hidden sibling a previous export is moved to while the new one takes its place."""
    return f".{final_name}.old-{tag}"


def export_rank_marker(rank: int) -> str:
    """File a consolidation rank leaves in the temporary export folder once its files are complete."""
    return f".rank-{rank:05d}.done"


def export_rank_failure(rank: int) -> str:
    """File a consolidation rank leaves in the temporary export folder when it failed (holds the message)."""
    return f".rank-{rank:05d}.failed"


#: ``checkpoint.incremental``: each rank's model files, the tensors that train apart from those that do not (frozen
#: parameters, buffers), which a save hard-links from the previous checkpoint when unchanged (``ondisk.incremental``).
#: safetensors: shard-0000R-model-00001-of-00002 (trained) and -00002-of-00002 (stable); torch_save: __R_0.distcp
#: (trained) and __R_2.distcp (stable).
INCREMENTAL_SHARDS = 2
STABLE_DCP_INDEX = 2


def dcp_rank_file(rank: int) -> str:
    return f"__{rank}_0.distcp"


def is_dcp_data_file(filename: str) -> bool:
    """A DCP data file (``__R_K.distcp``, as torch's ``FileSystemWriter`` names them)."""
    return filename.startswith("__") and filename.endswith(".distcp")


def eval_results_file(folder: Path, task: str) -> Path:
    """``ckpt-train eval``'s results of ``task`` for the checkpoint or export folder ``folder``."""
    return Path(folder) / EVAL_DIR / f"{task}{EVAL_SUFFIX}"


def archive_eval_dir(archive: Path) -> Path:
    """Where ``ckpt-train eval`` puts an archive's results: beside it, ``model.tar`` -> ``model.eval/``."""
    archive = Path(archive)
    return archive.parent / f"{archive.name.removesuffix(ARCHIVE_SUFFIX)}.{EVAL_DIR}"
