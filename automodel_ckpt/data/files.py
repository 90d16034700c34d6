"""Datasets from local files (json/jsonl, parquet, csv, arrow, text, `save_to_disk` folders) or the Hugging Face cache."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from automodel_ckpt.errors import ConfigError

if TYPE_CHECKING:  # imported where a dataset is loaded: the launcher's checks of dataset paths need none of it
    import datasets

_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text", ".text": "text",
             ".arrow": "arrow"}


def is_hub_id(path: str) -> bool:
    """Whether ``path`` reads as a Hub dataset id (``name`` or ``owner/name``) rather than a local path."""
    p = Path(path).expanduser()
    return not p.exists() and not any(ch in path for ch in "*?[") and not path.startswith((".", "/", "~")) \
        and path.count("/") <= 1 and Path(path).suffix not in _BUILDERS


def hub_dataset_cached(repo_id: str) -> bool:
    """Whether the Hub dataset ``repo_id`` is in the local Hugging Face cache (hub files or prepared Arrow)."""
    import datasets
    from huggingface_hub import constants

    hub = Path(constants.HF_HUB_CACHE) / f"datasets--{repo_id.replace('/', '--')}"
    prepared = Path(datasets.config.HF_DATASETS_CACHE) / repo_id.replace("/", "___")
    return hub.is_dir() or prepared.is_dir()


def load_hub_dataset(repo_id: str, name: str | None, split: str) -> datasets.Dataset:
    """``datasets.load_dataset(repo_id, name, split=split)`` from the local cache, with a one-line error if absent."""
    import datasets

    if not hub_dataset_cached(repo_id):
        raise ConfigError(f"dataset.path: '{repo_id}' is neither a local path nor a dataset in the Hugging Face cache "
                          f"({datasets.config.HF_DATASETS_CACHE}); download it once where the Hub is reachable, or "
                          "point dataset.path at local files")
    try:
        return datasets.load_dataset(repo_id, name, split=split)
    except (ValueError, FileNotFoundError, ConnectionError) as exc:
        raise ConfigError(f"dataset.path: cannot load '{repo_id}' (split '{split}') from the cache: "
                          f"{str(exc).splitlines()[0]}") from None


def load_local_dataset(path: str, split: str = "train", format: str | None = None,
                       name: str | None = None) -> datasets.Dataset:
    """Load ``path`` (a file, a glob, a folder, or a cached Hub dataset id and ``name``) without the network."""
    import datasets

    if is_hub_id(path):
        return load_hub_dataset(path, name, split)
    p = Path(path).expanduser()
    files: list[str]
    if p.is_dir():
        if (p / "dataset_info.json").exists() or (p / "dataset_dict.json").exists():
            ds = datasets.load_from_disk(str(p))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise ConfigError(f"dataset.split: '{split}' not in {p} (has: {', '.join(ds)})")
                ds = ds[split]
            return ds
        files = sorted(str(f) for f in p.iterdir() if f.suffix in _BUILDERS)
    elif any(ch in str(p) for ch in "*?["):
        files = sorted(str(f) for f in Path(p.anchor or ".").glob(str(p.relative_to(p.anchor)) if p.anchor else str(p)))
    elif p.exists():
        files = [str(p)]
    else:
        raise ConfigError(f"dataset.path: '{path}' not found")
    if not files:
        raise ConfigError(f"dataset.path: no data files (json, jsonl, parquet, csv, txt) in '{path}'")
    builder = format or _BUILDERS.get(Path(files[0]).suffix)
    if builder is None:
        raise ConfigError(f"dataset.format: cannot tell the format of '{files[0]}'; set dataset.format")
    return datasets.load_dataset(builder, data_files=files, split="train")
