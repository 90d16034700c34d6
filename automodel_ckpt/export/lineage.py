"""Where a checkpoint or an export came from: its parents, each by path and by content fingerprint.

A record is ``{"parents": [...], "data": {...}}``; each parent is ``{"role", "path", "fingerprint"}`` (plus what its
role adds) with its own record embedded, so the chain reads whole when a parent is gone. Fingerprints are bounded
reads, never all the weights. Records live in a checkpoint's ``metadata.json``, an export folder's
``automodel_lineage.json``, an exported file's metadata (read by its target) and an archive's copy of the checkpoint's
metadata; read back they are untrusted data of at most ``RECORD_LIMIT`` bytes. docs/inspect-and-diff.md#lineage says
what each role and fingerprint is; ``lineage_walk`` which parents are looked at on disk.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterator

from automodel_ckpt.errors import CheckpointError
from automodel_ckpt.ondisk import (Archive, CheckpointFolder, HFFolder, MiB, check_size, open_regular, parse_json,
                                   read_bytes)

RECORD_LIMIT = MiB  # bytes of a lineage record read back (a metadata.json holding one included): a small file
_INDEX = 64 * MiB  # bytes of a manifest, a config, an index or a safetensors header a fingerprint reads
EMBEDDED_LIMIT = 256 * 1024  # a parent's own lineage embedded in a record at most this large (JSON), else left out
_HEAD = MiB  # bytes of a file (an exported file, a .ckpt) its fingerprint reads
_SAMPLE = 256 * 1024  # bytes of weights read at each end of a safetensors file's data
_SAMPLED_FILES = 16  # safetensors files whose data is sampled (the others: their headers)


# ------------------------------------------------------------------------------------------ one listing's reads
class ReadsSpent(Exception):
    """A listing's ``Reads`` would go over its limit: the parent is named, not read."""


class Reads:
    """What one listing (``inspect --lineage``) may still read of the parents it meets, and the fingerprints it has
    taken: each folder or file fingerprinted once (by device and inode), at most ``limit`` bytes read in all."""

    def __init__(self, limit: int) -> None:
        self.limit = self.left = limit
        self.fingerprints: dict[tuple[int, int], str | None] = {}

    def take(self, n: int) -> None:
        """Count ``n`` bytes about to be read; ``ReadsSpent`` (nothing counted) when they do not fit."""
        if n > self.left:
            raise ReadsSpent
        self.left -= n


def _take(reads: Reads | None, n: int) -> None:
    if reads is not None:
        reads.take(n)


def _size(path: Path, follow: bool, cap: int) -> int:
    """The bytes a bounded reader reads of ``path`` (at most ``cap`` plus one: a larger file is refused)."""
    return min(os.stat(path, follow_symlinks=follow).st_size, cap + 1)


# ------------------------------------------------------------------------------------------ fingerprints
def _sha(parts: Iterator[bytes]) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return "sha256:" + digest.hexdigest()


def _safetensors_header(path: Path, follow: bool, sample: bool, reads: Reads | None = None) -> bytes:
    """A safetensors file's header and, with ``sample``, its size and the first and last ``_SAMPLE`` bytes of its
    data (weights trained from the same base have the same header)."""
    with os.fdopen(open_regular(path, follow=follow), "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        check_size(n, f"'{path}'", "a safetensors header", _INDEX)
        _take(reads, 8 + n + (2 * _SAMPLE if sample else 0))
        out = head + f.read(n)
        if sample:
            size = os.fstat(f.fileno()).st_size
            out += size.to_bytes(8, "little") + f.read(_SAMPLE)
            f.seek(max(f.tell(), size - _SAMPLE))
            out += f.read(_SAMPLE)
        return out


def _file_head(path: Path, follow: bool, reads: Reads | None = None) -> bytes:
    """A file's size and first ``_HEAD`` bytes."""
    with os.fdopen(open_regular(path, follow=follow), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        _take(reads, min(size, _HEAD))
        return size.to_bytes(8, "little") + f.read(_HEAD)


def _read_small(path: Path, what: str, follow: bool, reads: Reads | None) -> bytes:
    _take(reads, _size(path, follow, _INDEX))
    return read_bytes(path, what, _INDEX, follow=follow)


def lineage_fingerprint(path: str | Path, *, follow: bool = False, reads: Reads | None = None) -> str | None:
    """The content fingerprint of a checkpoint, a Hugging Face folder or a file (None: nothing to read, e.g. a Hub
    name). ``follow``: links are followed (a path the user named: an HF cache is links). ``reads``: a listing's."""
    path = Path(path)
    key = None
    try:
        if path.is_symlink() and not follow:
            return None
        if reads is not None:
            st = os.stat(path, follow_symlinks=follow)
            key = (st.st_dev, st.st_ino)
            if key in reads.fingerprints:
                return reads.fingerprints[key]
        value = _fingerprint(path, follow, reads)
    except (OSError, CheckpointError):
        value = None
    if key is not None and reads is not None:
        reads.fingerprints[key] = value
    return value


def _fingerprint(path: Path, follow: bool, reads: Reads | None) -> str | None:
    if path.is_file():
        return _sha(iter([_file_head(path, follow, reads)]))
    if not path.is_dir():
        return None
    if CheckpointFolder(path).metadata.is_file():
        name = CheckpointFolder.manifest if CheckpointFolder(path).manifest.is_file() else CheckpointFolder.metadata
        return _sha(iter([name.encode(), _read_small(path / name, "a checkpoint's manifest", follow, reads)]))
    parts = []
    for name in (HFFolder.config, HFFolder.index):
        if (path / name).is_file():
            parts.append(name.encode() + b"\0" + _read_small(path / name, "a model config", follow, reads))
    for i, weights in enumerate(sorted(path.glob("*.safetensors"))[:4096]):
        parts.append(weights.name.encode() + b"\0" + _safetensors_header(weights, follow, i < _SAMPLED_FILES, reads))
    return _sha(iter(parts)) if parts else None


# ------------------------------------------------------------------------------------------ records
def lineage_parent(role: str, path: str | Path, *, follow: bool = False, reads: Reads | None = None,
                   **extra: Any) -> dict[str, Any]:
    """A parent entry: its role, path (absolute where it is on disk), fingerprint, what ``extra`` adds, and its own
    lineage embedded (when it has one and it is small). ``reads``: a listing's."""
    where = Path(path)
    shown = str(where.absolute()) if where.exists() else str(path)
    entry: dict[str, Any] = {"role": role, "path": shown,
                             "fingerprint": lineage_fingerprint(where, follow=follow, reads=reads), **extra}
    try:
        own = read_lineage(where, reads=reads)
    except CheckpointError:
        own = None
    if own and len(json.dumps(own)) <= EMBEDDED_LIMIT:
        entry["lineage"] = own
    return entry


def training_lineage(model_path: Any, restored: Path | None, restore_from: Any, checkpoint_dir: Path | None,
                    data: dict[str, Any] | None = None) -> dict[str, Any]:
    """The lineage of a training run's checkpoints: its base model, where it restored or resumed from, its data."""
    parents = []
    if model_path:
        parents.append(lineage_parent("base model", str(model_path), follow=True))
    if restored is not None:
        own = checkpoint_dir is not None and Path(restored).absolute().parent == Path(checkpoint_dir).absolute()
        parents.append(lineage_parent("resumed from" if own else "restored from", restored))
    elif restore_from and str(restore_from) not in ("auto", "none", "null", "None"):
        parents.append(lineage_parent("restored from", str(restore_from)))
    record: dict[str, Any] = {"parents": parents}
    if data:
        record["data"] = data
    return record


def export_lineage(sources: list[str | Path], **extra: Any) -> dict[str, Any]:
    """The lineage of an export: the checkpoint(s) or folder(s) it was written from."""
    return {"parents": [lineage_parent("exported from", source, follow=True, **extra) for source in sources]}


def data_identity(cfg: Any, rows: Any = None) -> dict[str, Any]:
    """The training data's identity: a hash of the ``dataset`` and ``data`` sections and, for map-style data, the
    datasets library's fingerprint of its rows."""
    from omegaconf import OmegaConf

    from automodel_ckpt.redact import redacted

    sections = {k: OmegaConf.to_container(cfg[k], resolve=False) if cfg.get(k) is not None else None
                for k in ("dataset", "data")}
    out: dict[str, Any] = {"fingerprint": _sha(iter([json.dumps(redacted(sections), sort_keys=True,
                                                                default=str).encode()]))}
    rows_fp = getattr(rows, "_fingerprint", None)
    if isinstance(rows_fp, str):
        out["rows"] = rows_fp[:200]
    return out


# ------------------------------------------------------------------------------------------ reading
def _check(record: Any, where: str) -> dict[str, Any]:
    if not isinstance(record, dict) or not isinstance(record.get("parents", []), list):
        raise CheckpointError(f"{where} holds no lineage record (a mapping with a list of parents)")
    return record


def read_archive_lineage(path: Path) -> dict[str, Any] | None:
    """An archive's lineage: the checkpoint it was packed from (its metadata's name) and that checkpoint's parents."""
    from automodel_ckpt.export.archive import open_archive

    with open_archive(path) as archive:
        if Archive.METADATA not in archive.members:
            return None
        meta = archive.json(Archive.METADATA, "a lineage record", RECORD_LIMIT)
    if not isinstance(meta, dict):
        return None
    entry: dict[str, Any] = {"role": "packed from", "path": None, "checkpoint": str(meta.get("name"))[:4096],
                             "fingerprint": None}
    if isinstance(meta.get("lineage"), dict):
        entry["lineage"] = _check(meta["lineage"], f"'{path}'")
    return {"parents": [entry]}


def read_lineage(path: str | Path, *, follow: bool = False, reads: Reads | None = None) -> dict[str, Any] | None:
    """The lineage recorded in ``path`` (a checkpoint, an export folder, an export target's file, an archive; a
    checkpoint's own ``model/consolidated`` has the checkpoint as parent), or None. A record over ``RECORD_LIMIT``
    bytes or not a record: one-line ``CheckpointError``."""
    path = Path(path)
    if path.is_symlink() and not follow:
        return None
    if path.is_file():
        from automodel_ckpt.export.archive import is_archive
        from automodel_ckpt.export.registry import identify

        _take(reads, RECORD_LIMIT)  # a header walked (arrays and data skipped) for a record of at most this
        target = identify(path)
        if target is not None:  # the record an export wrote into its file, as JSON text
            text = target.lineage_text(path, RECORD_LIMIT)
            return None if text is None else _check(parse_json(text, f"'{path}'", "a lineage record", RECORD_LIMIT),
                                                    f"'{path}'")
        return read_archive_lineage(path) if is_archive(path) else None
    if not path.is_dir():
        return None
    for name, key in ((CheckpointFolder.metadata, "lineage"), (HFFolder.lineage, None)):
        file = path / name
        if file.is_symlink() or not file.exists():
            continue
        try:
            _take(reads, _size(file, False, RECORD_LIMIT))
            data = read_bytes(file, "a lineage record", RECORD_LIMIT, follow=False)
        except OSError:
            return None
        record = parse_json(data, f"'{file}'", "a lineage record", RECORD_LIMIT)
        if key is not None:
            record = record.get(key) if isinstance(record, dict) else None
            if record is None:
                return None
        return _check(record, f"'{file}'")
    model_dir = path.parent
    if model_dir.name == CheckpointFolder.model and CheckpointFolder(model_dir.parent).metadata.is_file() \
            and not model_dir.is_symlink():
        return {"parents": [lineage_parent("exported from", model_dir.parent, reads=reads)]}
    return None

