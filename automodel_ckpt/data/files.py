"""Datasets from local files: json/jsonl, parquet, csv, plain text, or a `save_to_disk` folder."""

from __future__ import annotations

from pathlib import Path

import datasets

from automodel_ckpt.errors import ConfigError

_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text", ".text": "text"}


def load_local_dataset(path: str, split: str = "train", format: str | None = None) -> datasets.Dataset:
    """Load ``path`` (a file, a glob, or a folder) without touching the network.

    A folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` is loaded with ``load_from_disk``;
    any other folder is read as the files inside it with the builder of their extension.
    """
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
