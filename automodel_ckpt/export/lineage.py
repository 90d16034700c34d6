"""Where a checkpoint or an export came from: its parents, each by path and by content fingerprint.

A lineage record is ``{"parents": [...], "data": {...}}``. Each parent is ``{"role", "path", "fingerprint"}`` (and
what its role adds: an import's ``trainer`` and ``step``), with the parent's own parents embedded below it, so
that the chain reads whole when a parent folder is gone. Roles: ``base model`` (``model.pretrained_model_name_or_
path``), ``restored from`` (``checkpoint.restore_from``), ``resumed from`` (the checkpoint a launch continued),
``imported from`` (another trainer's checkpoint) and ``exported from`` (the checkpoint an export, an archive, an
average or an HF Trainer folder was written from: an average lists each of its sources).

Fingerprints are cheap and bounded, never a read of all the weights: a checkpoint of ours by its manifest (the size
and checksum of every file) or else its metadata; a Hugging Face folder by its ``config.json``, its safetensors
index, the header of each weights file and 256 KiB at each end of the data of the first 16; a file by its size and
first MiB.

Where it lives: a checkpoint's ``metadata.json`` (``lineage``), a Hugging Face export folder's ``LINEAGE_FILE``
(``ondisk.layout``), a GGUF file's ``automodel_ckpt.lineage`` key (JSON text), an archive's copy of the checkpoint's
metadata. Read back it is data: at most ``RECORD_LIMIT`` bytes (1 MiB) (a larger record is refused in one line), every
value escaped when printed, and a parent is only looked at on disk as a regular folder or file, never through a
link; only its own lineage record is read there, with the same bounded readers.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Any, Iterator

from automodel_ckpt.errors import CheckpointError
from automodel_ckpt.ondisk import bounded, layout
from automodel_ckpt.ondisk.paths import open_regular
from automodel_ckpt.shown import one_line

GGUF_KEY = "automodel_ckpt.lineage"  # the GGUF metadata key that holds an export's lineage (JSON text)
RECORD_LIMIT = bounded.MiB  # bytes of a lineage record read back (a metadata.json holding one included): a small file
_INDEX = 64 * bounded.MiB  # bytes of a manifest, a config, an index or a safetensors header a fingerprint reads
EMBEDDED_LIMIT = 256 * 1024  # a parent's own lineage embedded in a record at most this large (JSON), else left out
MAX_DEPTH = 32  # generations printed
_HEAD = bounded.MiB  # bytes of a file (a GGUF, a .ckpt) its fingerprint reads
_SAMPLE = 256 * 1024  # bytes of weights read at each end of a safetensors file's data
_SAMPLED_FILES = 16  # safetensors files whose data is sampled (the others: their headers)


# ------------------------------------------------------------------------------------------ fingerprints
def _sha(parts: Iterator[bytes]) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return "sha256:" + digest.hexdigest()


def _safetensors_header(path: Path, follow: bool, sample: bool) -> bytes:
    """A safetensors file's header and, with ``sample``, its size and the first and last ``_SAMPLE`` bytes of its
    data (weights trained from the same base have the same header)."""
    with os.fdopen(open_regular(path, follow=follow), "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        bounded.check_size(n, f"'{path}'", "a safetensors header", _INDEX)
        out = head + f.read(n)
        if sample:
            size = os.fstat(f.fileno()).st_size
            out += size.to_bytes(8, "little") + f.read(_SAMPLE)
            f.seek(max(f.tell(), size - _SAMPLE))
            out += f.read(_SAMPLE)
        return out


def _file_head(path: Path, follow: bool) -> bytes:
    with os.fdopen(open_regular(path, follow=follow), "rb") as f:
        return os.fstat(f.fileno()).st_size.to_bytes(8, "little") + f.read(_HEAD)


def lineage_fingerprint(path: str | Path, *, follow: bool = False) -> str | None:
    """The content fingerprint of a checkpoint, a Hugging Face folder or a file (None: nothing there to read, e.g. a
    model name on the Hub). ``follow``: links are followed (a path the user named: an HF cache is links)."""
    path = Path(path)
    try:
        if path.is_symlink() and not follow:
            return None
        if path.is_file():
            return _sha(iter([_file_head(path, follow)]))
        if not path.is_dir():
            return None
        if (path / layout.METADATA_FILE).is_file():
            name = layout.MANIFEST_FILE if (path / layout.MANIFEST_FILE).is_file() else layout.METADATA_FILE
            return _sha(iter([name.encode(), bounded.read_bytes(path / name, "a checkpoint's manifest", _INDEX,
                                                        follow=follow)]))
        parts = []
        for name in (layout.HF_CONFIG, layout.HF_INDEX):
            if (path / name).is_file():
                parts.append(name.encode() + b"\0" + bounded.read_bytes(path / name, "a model config", _INDEX,
                                                                 follow=follow))
        for i, weights in enumerate(sorted(path.glob("*.safetensors"))[:4096]):
            parts.append(weights.name.encode() + b"\0" + _safetensors_header(weights, follow, i < _SAMPLED_FILES))
        return _sha(iter(parts)) if parts else None
    except (OSError, CheckpointError):
        return None


# ------------------------------------------------------------------------------------------ records
def lineage_parent(role: str, path: str | Path, *, follow: bool = False, **extra: Any) -> dict[str, Any]:
    """A parent entry: its role, path (absolute where it is on disk), fingerprint, what ``extra`` adds, and its own
    lineage embedded (when it has one and it is small)."""
    where = Path(path)
    shown = str(where.absolute()) if where.exists() else str(path)
    entry: dict[str, Any] = {"role": role, "path": shown, "fingerprint": lineage_fingerprint(where, follow=follow),
                             **extra}
    try:
        own = read_lineage(where)
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


def lineage_json(record: dict[str, Any]) -> str:
    return json.dumps(record, sort_keys=False, default=str)


# ------------------------------------------------------------------------------------------ reading
def _check(record: Any, where: str) -> dict[str, Any]:
    if not isinstance(record, dict) or not isinstance(record.get("parents", []), list):
        raise CheckpointError(f"{where} holds no lineage record (a mapping with a list of parents)")
    return record


def read_gguf_lineage(path: Path) -> dict[str, Any] | None:
    from automodel_ckpt.export.gguf_read import gguf_lineage_text

    text = gguf_lineage_text(path, RECORD_LIMIT)
    if text is None:
        return None
    return _check(bounded.parse_json(text, f"'{path}'", "a lineage record", RECORD_LIMIT), f"'{path}'")


def read_archive_lineage(path: Path) -> dict[str, Any] | None:
    """An archive's lineage: the checkpoint it was packed from (its metadata's name) and that checkpoint's parents."""
    from automodel_ckpt.export.archive import open_archive

    with open_archive(path) as archive:
        if layout.ARCHIVE_METADATA not in archive.members:
            return None
        meta = archive.json(layout.ARCHIVE_METADATA, "a lineage record", RECORD_LIMIT)
    if not isinstance(meta, dict):
        return None
    entry: dict[str, Any] = {"role": "packed from", "path": None, "checkpoint": str(meta.get("name"))[:4096],
                             "fingerprint": None}
    if isinstance(meta.get("lineage"), dict):
        entry["lineage"] = _check(meta["lineage"], f"'{path}'")
    return {"parents": [entry]}


def read_lineage(path: str | Path, *, follow: bool = False) -> dict[str, Any] | None:
    """The lineage recorded in ``path``: a checkpoint's metadata, an export folder's lineage file (or, for a
    checkpoint's own ``model/consolidated``, the checkpoint), a GGUF file's key. None: none recorded. A record over
    ``RECORD_LIMIT`` bytes or not a record: one-line ``CheckpointError``."""
    path = Path(path)
    if path.is_symlink() and not follow:
        return None
    if path.is_file():
        from automodel_ckpt.export.archive import is_archive
        from automodel_ckpt.export.gguf_read import is_gguf

        if is_gguf(path):
            return read_gguf_lineage(path)
        return read_archive_lineage(path) if is_archive(path) else None
    if not path.is_dir():
        return None
    for name, key in ((layout.METADATA_FILE, "lineage"), (layout.LINEAGE_FILE, None)):
        file = path / name
        if file.is_symlink() or not file.exists():
            continue
        try:
            data = bounded.read_bytes(file, "a lineage record", RECORD_LIMIT, follow=False)
        except OSError:
            return None
        record = bounded.parse_json(data, f"'{file}'", "a lineage record", RECORD_LIMIT)
        if key is not None:
            record = record.get(key) if isinstance(record, dict) else None
            if record is None:
                return None
        return _check(record, f"'{file}'")
    model_dir = path.parent
    if model_dir.name == layout.MODEL_DIR and (model_dir.parent / layout.METADATA_FILE).is_file() \
            and not model_dir.is_symlink():
        # a checkpoint's own consolidated export: the checkpoint is its parent
        return {"parents": [lineage_parent("exported from", model_dir.parent)]}
    return None


def _status(entry: dict[str, Any]) -> tuple[str, bool]:
    """How ``entry``'s path is now ("present", "gone", "changed: now ...", "a link: not followed") and whether it
    may be read (a regular folder or file, not a link)."""
    if not isinstance(entry.get("path"), str) or not entry["path"]:
        return "recorded in the archive", False
    path = Path(entry["path"])
    try:
        mode = os.lstat(path).st_mode
    except (OSError, ValueError):
        return "gone", False
    if stat.S_ISLNK(mode):
        return "a link: not followed", False
    if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
        return "not a folder or file: not read", False
    recorded = entry.get("fingerprint")
    if recorded is None:
        return "present", True
    now = lineage_fingerprint(path)
    if now is None or now == recorded:
        return "present", True
    return f"changed: now {now}", True


def lineage_chain(target: str | Path) -> list[str]:
    """The lines of ``inspect --lineage``: ``target`` and each generation of parents below it, indented, with
    fingerprints and whether each parent is still there; every value escaped."""
    target = Path(target)
    record = read_lineage(target, follow=True)  # the path the user named
    own = lineage_fingerprint(target, follow=True)
    lines = [one_line(f"lineage of '{target}'" + (f" ({own})" if own else ""))]
    if record is None:
        return lines + ["  no lineage recorded (written before lineage was, or not by ckpt-train)"]
    _walk(record, 1, lambda depth, text: lines.append("  " * depth + one_line(text)), {str(target.absolute())},
          set())
    return lines


def _walk(record: dict[str, Any], depth: int, add: Any, ancestors: set[str], expanded: set[str]) -> None:
    """``record``'s parents at ``depth``, each followed by its own. ``ancestors``: the parents on the way down to
    here (one of them again is a cycle, not followed); ``expanded``: parents whose parents are listed already (a
    shared ancestor, such as the base model of both a run and the run it was restored from, is listed once)."""
    if depth > MAX_DEPTH:
        add(depth, f"... (more than {MAX_DEPTH} generations: not shown)")
        return
    data = record.get("data")
    parents = record.get("parents") or []
    for entry in parents[:256]:
        if not isinstance(entry, dict):
            add(depth, "(an entry that is no parent)")
            continue
        status, readable = _status(entry)
        extra = "".join(f", {k} {entry[k]}" for k in ("trainer", "step") if entry.get(k) is not None)
        add(depth, f"{entry.get('role', 'parent')}: {entry.get('path') or entry.get('checkpoint')} "
                   f"({entry.get('fingerprint') or 'no fingerprint'}{extra}) [{status}]")
        key = str(entry.get("path") or id(entry))
        if key in ancestors:
            add(depth + 1, "(its own ancestor: a cycle, not followed)")
            continue
        if key in expanded:
            add(depth + 1, "(its parents are listed above)")
            continue
        below = entry.get("lineage")
        if readable and not isinstance(below, dict):
            try:
                below = read_lineage(Path(key))
            except CheckpointError as exc:
                add(depth + 1, str(exc))
                below = None
        if isinstance(below, dict):
            expanded.add(key)
            _walk(below, depth + 1, add, ancestors | {key}, expanded)
    if isinstance(data, dict):
        rows = f", rows {data['rows']}" if data.get("rows") else ""
        add(depth, f"training data: {data.get('fingerprint')}{rows}")


def write_lineage_file(folder: str | Path, record: dict[str, Any]) -> Path:
    """``record`` as ``folder``'s lineage file (an export folder: Hugging Face, int8, HF Trainer), written whole."""
    file = Path(folder) / layout.LINEAGE_FILE
    tmp = file.with_name(f".{layout.LINEAGE_FILE}.partial")
    tmp.write_text(json.dumps(record, indent=2, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, file)
    return file
