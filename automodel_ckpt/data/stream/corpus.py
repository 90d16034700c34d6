"""The streamed ``dataset:`` target and the shard listing (path, size, version) that is a streamed corpus's identity."""

from __future__ import annotations

import itertools
import os
import re
from dataclasses import dataclass, field
from typing import Any

from automodel_ckpt.errors import ConfigError, expect

#: A parquet file larger than this is one shard per row group (its footer read once, when the corpus is listed).
SPLIT_PARQUET_BYTES = 256 * 2**20
HUB_FILES = "**/*.parquet"  # a Hub dataset's files read by default (the Hub stores most datasets as parquet)
_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+(@[\w.%-]+)?")  # OWNER/NAME[@REVISION] (a branch as refs%2Fconvert%2Fparquet)
#: The shortest byte range a line file is cut into to fill the lanes (a range holds the lines that start in it).
MIN_RANGE_BYTES = 64 * 2**10
#: The file formats a streamed source reads, by suffix (after a compression suffix such as .gz or .zst).
FORMATS = {".jsonl": "json", ".json": "json", ".txt": "text", ".text": "text", ".parquet": "parquet", ".arrow": "arrow"}
_COMPRESSED = (".gz", ".zst", ".zstd", ".bz2", ".xz")


@dataclass(frozen=True)
class Shard:
    """A source's unit (a file, row group or byte range) and its file's version (mtime in ns, or ETag)."""

    path: str
    size: int
    version: str
    first: int = 0
    stop: int = -1  # the row after the shard's last (-1: the end of the file)

    @property
    def name(self) -> str:
        if self.stop < 0:
            return self.path
        unit = "rows" if file_format(self.path, None, strict=False) in ("parquet", "arrow") else "bytes"
        return f"{self.path} {unit} {self.first}-{self.stop - 1}"

    def record(self) -> list[Any]:
        whole = [self.path, self.size, self.version]
        return whole if self.stop < 0 else [*whole, self.first, self.stop]


@dataclass
class Source:
    """One source of a corpus: file globs read with one format; ``weight`` is its share of a blend's documents."""

    paths: list[str]
    weight: float = 1.0
    format: str | None = None


@dataclass
class Corpus:
    """What a streamed ``dataset:`` section names (nothing is read until ``list_shards``)."""

    sources: list[Source]
    text_field: str | None = None
    storage_options: dict[str, Any] | None = field(default=None, repr=False)
    max_sequences: int | None = None  # validation: the first N sequences of the stream
    split_parquet_bytes: int = SPLIT_PARQUET_BYTES
    min_range_bytes: int = MIN_RANGE_BYTES

    def list_shards(self, section: str = "dataset", lanes: int = 1) -> list[list[Shard]]:
        """Per source its units (``fill_lanes``: a source of fewer units than ``lanes`` has its files cut)."""
        listed = [list_source(s, self.storage_options, f"{section}.sources[{i}]" if len(self.sources) > 1
                              else f"{section}.path", self.split_parquet_bytes) for i, s in enumerate(self.sources)]
        return [fill_lanes(units, lanes, self.storage_options, s.format, self.min_range_bytes)
                for units, s in zip(listed, self.sources)]


def streamed_corpus(path: str | list[str] | None = None, sources: list[dict[str, Any]] | None = None,
                    format: str | None = None, text_field: str | None = None,
                    storage_options: dict[str, Any] | None = None, max_sequences: int | None = None,
                    split_parquet_mb: float = SPLIT_PARQUET_BYTES / 2**20, hub: str | None = None,
                    files: str | list[str] = HUB_FILES) -> Corpus:
    """A corpus read as a stream (docs/data.md, "Streaming"): ``path`` globs, a blend's ``sources``, or a ``hub``."""
    if sum(x is not None for x in (path, sources, hub)) != 1:
        raise ConfigError("dataset: a streamed corpus takes one of dataset.path, dataset.sources, dataset.hub")
    if hub is not None:
        path = hub_globs(hub, _globs(files, "dataset.files"))
    if path is not None:
        listed = [Source(_globs(path, "dataset.path"), 1.0, format)]
    else:
        listed = []
        for i, s in enumerate(sources or []):
            s = dict(s)
            if "path" not in s:
                raise ConfigError(f"dataset.sources[{i}]: needs a path")
            weight = float(s.pop("weight", 1.0))
            if weight <= 0:
                raise ConfigError(f"dataset.sources[{i}].weight: expected > 0, got {weight:g}")
            listed.append(Source(_globs(s.pop("path"), f"dataset.sources[{i}].path"), weight, s.pop("format", format)))
            if s:
                raise ConfigError(f"dataset.sources[{i}]: unknown key '{next(iter(s))}' (keys: path, weight, format)")
        if not listed:
            raise ConfigError("dataset.sources: empty")
    expect(max_sequences is None or max_sequences >= 1, "dataset.max_sequences", "a positive integer", max_sequences)
    return Corpus(listed, text_field, dict(storage_options) if storage_options else None, max_sequences,
                  int(split_parquet_mb * 2**20))


streamed_corpus.streamed = True  # type: ignore[attr-defined]  # what ``is_streamed`` looks for


def is_streamed(section: Any) -> bool:
    """Whether a ``dataset:`` section names a streamed corpus (its target is marked ``streamed``)."""
    if section is None or not isinstance(section.get("_target_"), str) or ":" in section.get("_target_"):
        return False
    from automodel_ckpt.config.instantiate import locate

    try:
        return bool(getattr(locate(section.get("_target_")), "streamed", False))
    except ConfigError:
        return False


def hub_globs(hub: str, files: list[str]) -> list[str]:
    """The fsspec URLs (``hf://datasets/...``, read through huggingface_hub) of a Hub dataset's files."""
    if not isinstance(hub, str) or not _HUB_ID.fullmatch(hub) or \
            any(part in (".", "..") for part in hub.partition("@")[0].split("/")):
        raise ConfigError(f"dataset.hub: expected a Hub dataset id OWNER/NAME (optionally @REVISION), got {hub!r}")
    for pattern in files:
        expect(not pattern.startswith("/") and ".." not in pattern.split("/"), "dataset.files",
               "globs inside the dataset's repository", pattern)
    return [f"hf://datasets/{hub}/{pattern}" for pattern in files]


def _globs(value: Any, key: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        return list(value)
    raise ConfigError(f"{key}: expected a path, a glob or a list of them, got {value!r}")


def file_format(path: str, format: str | None, strict: bool = True) -> str:
    """``format`` if set, else the suffix's under any compression (unknown: ``ConfigError``, or ``""``)."""
    if format is not None:
        if format not in set(FORMATS.values()):
            raise ConfigError(f"dataset.format: expected one of json, text, parquet, arrow, got '{format}'")
        return format
    name = path.lower()
    for c in _COMPRESSED:
        if name.endswith(c):
            name = name[: -len(c)]
    suffix = os.path.splitext(name)[1]
    if suffix not in FORMATS and not strict:
        return ""
    if suffix not in FORMATS:
        raise ConfigError(f"dataset.format: cannot tell the format of '{path}' (suffixes: "
                          f"{', '.join(FORMATS)}, optionally {', '.join(_COMPRESSED)}); set dataset.format")
    return FORMATS[suffix]


_FILESYSTEMS: dict[tuple[int, str, str], Any] = {}


def filesystem(path: str, storage_options: dict[str, Any] | None) -> tuple[Any, str]:
    """``(fsspec filesystem, path within it)``, credentials as for ``checkpoint_dir``; one per process."""
    import fsspec

    from automodel_ckpt.checkpoint import is_url

    if not is_url(path):
        return fsspec.filesystem("file"), os.path.abspath(os.path.expanduser(path.removeprefix("file://")))
    scheme, inner = path.split("://", 1)
    key = (os.getpid(), scheme.lower(), repr(sorted((storage_options or {}).items())))
    if key not in _FILESYSTEMS:
        from automodel_ckpt.checkpoint import open_filesystem

        _FILESYSTEMS[key] = open_filesystem(f"{scheme.lower()}://{inner}", storage_options)
    return _FILESYSTEMS[key], inner


def list_source(source: Source, storage_options: dict[str, Any] | None, key: str,
                split_parquet_bytes: int = SPLIT_PARQUET_BYTES) -> list[Shard]:
    """The source's shards, sorted by path; ``ConfigError`` for a glob that matches nothing."""
    from automodel_ckpt.checkpoint import check_url, is_url

    shards: dict[str, Shard] = {}
    for pattern in source.paths:
        if is_url(pattern):
            check_url(pattern, key, pattern=True)
        fs, inner = filesystem(pattern, storage_options)
        scheme = pattern.split("://", 1)[0] + "://" if is_url(pattern) else ""
        try:
            if any(ch in inner for ch in "*?["):
                found = fs.glob(inner, detail=True)
            elif fs.isdir(inner):
                found = dict(fs.find(inner, detail=True))
            else:
                found = {inner: fs.info(inner)}
        except FileNotFoundError:
            found = {}
        except (OSError, PermissionError) as exc:
            raise ConfigError(f"{key}: cannot list '{pattern}': {exc}") from None
        for p, info in found.items():
            if info.get("type") == "directory":
                continue
            file_format(p, source.format)  # a file of unknown format: one line now, not in a worker later
            version = info.get("ETag") or info.get("etag") or str(int(float(info.get("mtime", 0)) * 1e9)
                                                                   if "mtime" in info else info.get("LastModified", ""))
            shards[scheme + p] = Shard(scheme + p, int(info.get("size") or 0), str(version).strip('"'))
        if not found:
            raise ConfigError(f"{key}: no files match '{pattern}'")
    out: list[Shard] = []
    for p in sorted(shards):
        whole = shards[p]
        large = whole.size > split_parquet_bytes and file_format(p, source.format) == "parquet"
        out.extend(_row_group_shards(whole, storage_options) if large else [whole])
    return out


def fill_lanes(units: list[Shard], lanes: int, storage_options: dict[str, Any] | None, format: str | None,
               min_range_bytes: int = MIN_RANGE_BYTES) -> list[Shard]:
    """``units`` cut finer (row groups, byte ranges) when fewer than ``lanes``: a small corpus fills every lane."""
    if len(units) >= lanes:
        return units
    out: list[Shard] = []
    total = sum(u.size for u in units if u.stop < 0) or 1
    for u in units:
        fmt = file_format(u.path, format)
        if u.stop >= 0 or fmt == "arrow" or (fmt != "parquet" and u.path.lower().endswith(_COMPRESSED)):
            out.append(u)
        elif fmt == "parquet":
            out.extend(_row_group_shards(u, storage_options))
        else:
            pieces = max(1, min(-(-lanes * u.size // total), u.size // max(min_range_bytes, 1)))
            cuts = [u.size * i // pieces for i in range(pieces + 1)]
            out.extend(Shard(u.path, u.size, u.version, a, b) if pieces > 1 else u for a, b in zip(cuts, cuts[1:]))
    return out


def _row_group_shards(whole: Shard, storage_options: dict[str, Any] | None) -> list[Shard]:
    """A large parquet file as one shard per row group (the whole file if its footer cannot be read)."""
    import pyarrow.parquet as pq

    from automodel_ckpt.data.stream.regular import open_regular  # a local file: a FIFO is never waited on

    fs, inner = filesystem(whole.path, storage_options)
    local = "file" in (fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,))
    try:
        with (open_regular(inner) if local else fs.open(inner, "rb")) as f:
            meta = pq.ParquetFile(f).metadata
    except Exception:  # noqa: BLE001
        return [whole]
    if meta.num_row_groups < 2:
        return [whole]
    bounds = [0, *itertools.accumulate(meta.row_group(g).num_rows for g in range(meta.num_row_groups))]
    return [Shard(whole.path, whole.size, whole.version, first, stop) for first, stop in zip(bounds, bounds[1:])]
