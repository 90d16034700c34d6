"""Where a model source lies (local folder, Hugging Face cache, Hub) and its one download per node, safetensors only.

A Hub id resolves to its snapshot in the Hugging Face cache, downloaded if missing (config, tokenizer and
``*.safetensors``, never pickles) by the launcher once per node, or by a worker under a file lock in the cache.
Offline, one line says what is missing and the command that fetches it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from automodel_ckpt.ondisk import INDEX_FILE_LIMIT, check_path, read_json
from automodel_ckpt.errors import CheckpointError, ConfigError, first_line

logger = logging.getLogger(__name__)

#: The files a snapshot holds: configuration, tokenizer, chat template, generation config and safetensors weights.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
#: Top-level files only: subfolders (``original/``, ``onnx/``) hold other formats of the same weights.
IGNORE_PATTERNS = ["*/*"]

LOCAL, CACHED, DOWNLOAD, OFFLINE = "local folder", "cached", "to be downloaded", "unavailable offline"


@dataclass(frozen=True)
class ModelSource:
    """What a ``pretrained_model_name_or_path`` names: ``status`` is one of LOCAL, CACHED, DOWNLOAD, OFFLINE."""

    name: str
    status: str
    path: Path | None = None  # the folder to read (LOCAL, CACHED)
    key: str = "model.pretrained_model_name_or_path"  # the recipe key that names it

    def require_available(self) -> None:
        """``ConfigError`` (one line, with the command that fetches it) when the model is unavailable offline."""
        if self.status == OFFLINE:
            raise ConfigError(_offline_message(self.name, self.key))

    def describe(self) -> str:
        """One line for ``--dry-run``: where the model is, or what fetching it takes."""
        if self.status == LOCAL:
            return f"'{self.name}': local folder"
        if self.status == CACHED:
            return f"'{self.name}': cached ({self.path})"
        if self.status == DOWNLOAD:
            return f"'{self.name}': to be downloaded from {_endpoint()} (safetensors, once per node)"
        return f"'{self.name}': unavailable offline (not in {_cache_dir()}); fetch it with: {fetch_command(self.name)}"


def is_hub_id(name: str) -> bool:
    """Whether ``name`` reads as a Hub model id (``name`` or ``owner/name``) rather than a local path."""
    if not name or name.startswith((".", "/", "~")) or name.count("/") > 1 or Path(name).expanduser().exists():
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def fetch_command(repo_id: str) -> str:
    """The shell command that puts ``repo_id`` into the Hugging Face cache the way a run would."""
    includes = " ".join(f"--include '{p}'" for p in ALLOW_PATTERNS)
    return f"hf download {repo_id} {includes} --exclude '*/*'"


def cached_snapshot(repo_id: str, weights: bool = True) -> Path | None:
    """The complete cached snapshot of ``repo_id`` (with weights, if ``weights``), or None; no network."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, IncompleteSnapshotError, LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=ALLOW_PATTERNS, ignore_patterns=IGNORE_PATTERNS,
                                        local_files_only=True))
    except (LocalEntryNotFoundError, IncompleteSnapshotError, HFValidationError, OSError):
        return None
    if weights and not ((folder / "config.json").exists() and _has_all_weights(folder)):
        return None
    return folder


def _has_all_weights(folder: Path) -> bool:
    """Safetensors weights, and every shard an index names (a snapshot cached file by file may lack some)."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = read_json(index, "a weights index", INDEX_FILE_LIMIT, follow=True).get("weight_map")
            shards = {check_path(shard, f"'{index}'") for shard in weight_map.values()}
        except (OSError, AttributeError, CheckpointError):
            return False
        return bool(shards) and all((folder / shard).exists() for shard in shards)
    return any(folder.glob("*.safetensors"))


def model_source(name: str, key: str = "model.pretrained_model_name_or_path", weights: bool = True) -> ModelSource:
    """Where ``name`` lies now (``weights=False``: a tokenizer's, no config.json); else ``ConfigError``."""
    p = Path(name).expanduser()
    if (p / "config.json").exists() or (not weights and p.is_dir()):
        return ModelSource(name, LOCAL, p, key)
    if not is_hub_id(name):
        raise ConfigError(f"{key}: '{name}' not found (expected a local folder with config.json, or a Hugging Face "
                          "Hub id such as meta-llama/Llama-3.2-1B)")
    cached = cached_snapshot(name, weights)
    if cached is not None:
        return ModelSource(name, CACHED, cached, key)
    return ModelSource(name, OFFLINE if offline() else DOWNLOAD, None, key)


def model_folder(name: str, key: str = "model.pretrained_model_name_or_path", weights: bool = True) -> Path:
    """The local folder of ``name``: the folder itself, or a Hub id's snapshot, downloaded (under a lock) if missing."""
    source = model_source(name, key, weights)
    if source.path is not None:
        return source.path
    source.require_available()
    from filelock import FileLock

    lock = Path(_cache_dir()) / ".locks" / f"automodel_ckpt--{name.replace('/', '--')}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(lock)):
        cached = cached_snapshot(name, weights)  # another process may have downloaded it while this one waited
        return cached if cached is not None else _download(name, key, weights)


def _download(repo_id: str, key: str, weights: bool) -> Path:
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, OfflineModeIsEnabled, RepositoryNotFoundError

    rank = os.environ.get("RANK")
    who = f" (rank {rank})" if rank not in (None, "0") else ""
    try:
        files = HfApi().list_repo_files(repo_id)
        if weights and not any(f.endswith(".safetensors") and "/" not in f for f in files):
            raise ConfigError(f"{key}: '{repo_id}' has no safetensors weights on the "
                              "Hub (only pickled .bin/.pt files, which are never loaded); convert it to safetensors "
                              "into a local folder and point the recipe there")
        logger.info("downloading %s from %s into %s", repo_id, _endpoint(), _cache_dir())
        print(f"Downloading {repo_id} (config, tokenizer, safetensors) into {_cache_dir()}{who}", flush=True)
        folder = snapshot_download(repo_id, allow_patterns=ALLOW_PATTERNS, ignore_patterns=IGNORE_PATTERNS)
    except OfflineModeIsEnabled:
        raise ConfigError(_offline_message(repo_id, key)) from None
    except HfHubHTTPError as exc:  # GatedRepoError and RepositoryNotFoundError among them
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if isinstance(exc, GatedRepoError) or status in (401, 403):  # 401: a private repo or a missing one alike
            raise ConfigError(f"{key}: '{repo_id}' is gated or private: accept its licence at {_endpoint()}/{repo_id} "
                              "and set HF_TOKEN (or run `hf auth login`)") from None
        if isinstance(exc, RepositoryNotFoundError):
            raise ConfigError(f"{key}: '{repo_id}' not found on {_endpoint()} (nor a local folder)") from None
        raise ConfigError(f"{key}: downloading '{repo_id}' failed: {first_line(exc)}") from None
    except _network_errors() as exc:  # no network: DNS, refused connection, timeout
        raise ConfigError(f"{_offline_message(repo_id, key)} ({type(exc).__name__})") from None
    return Path(folder)


def _network_errors() -> tuple[type[BaseException], ...]:
    """The exceptions of an unreachable Hub, from whichever HTTP client this huggingface_hub uses."""
    import importlib

    found: list[type[BaseException]] = [OSError, ConnectionError]
    for module, names in (("httpx2", ("TransportError",)), ("httpx", ("TransportError",)),
                          ("requests", ("ConnectionError", "Timeout"))):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        found += [getattr(mod, n) for n in names if isinstance(getattr(mod, n, None), type)]
    return tuple(found)


def _offline_message(repo_id: str, key: str) -> str:
    return (f"{key}: '{repo_id}' is neither a local folder nor in the Hugging Face cache ({_cache_dir()}), and the "
            f"Hub cannot be reached (offline); fetch it where the Hub is reachable with: {fetch_command(repo_id)}")


def _cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def _endpoint() -> str:
    from huggingface_hub import constants

    return str(constants.ENDPOINT)
