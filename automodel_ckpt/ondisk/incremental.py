"""Incremental saves: a file whose bytes equal the previous published checkpoint's is hard-linked there, not written.

Every folder still holds every file, and where a link fails the file is written: docs/checkpointing.md."""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from automodel_ckpt.ondisk import paths

_CHUNK = 8 << 20
_KEYS: dict[str, tuple[int, int, int, str]] = {}  # stable file (absolute path) -> (inode, size, mtime_ns, content key)
_KEYS_LOCK = threading.Lock()


def _hasher() -> Any:
    try:
        import xxhash
    except ImportError:
        return hashlib.blake2b(digest_size=16)
    return xxhash.xxh3_128()


def key_of(path: Path) -> str | None:
    """The content key of the stable file at ``path`` when this process wrote or linked it and it is unchanged."""
    where = os.path.abspath(os.fspath(path))
    with _KEYS_LOCK:
        known = _KEYS.get(where)
    if known is None:
        return None
    try:
        st = os.stat(where, follow_symlinks=False)
    except OSError:
        return None
    return known[3] if (st.st_ino, st.st_size, st.st_mtime_ns) == known[:3] else None


def content_key(pieces: list[Any]) -> str:
    """A 128-bit hash of the bytes ``pieces`` make back to back (``filewrite`` pieces: bytes, memoryviews, Lazy)."""
    h = _hasher()
    for piece in pieces:
        if hasattr(piece, "materialise"):
            _, view = piece.materialise()
        else:
            view = memoryview(piece).cast("B") if not isinstance(piece, memoryview) else piece
        for start in range(0, view.nbytes, _CHUNK):
            h.update(view[start:start + _CHUNK])
    return h.hexdigest()


@dataclass(frozen=True)
class _Kept:
    """One file of a save: where it is, its size, reuse key, manifest checksum, and the inode and mtime it had."""

    path: Path
    size: int
    key: str
    algorithm: str | None
    digest: str | None
    ino: int
    mtime_ns: int


class Reuse:
    """The stable files of the checkpoint this writer published last, and of the save being made. Thread-safe."""

    def __init__(self) -> None:
        self._previous: dict[str, _Kept] = {}
        self._current: dict[str, _Kept] = {}
        self._adopted: Path | None = None  # a resumed run: the checkpoint it resumed from (``adopt``)
        self._keyed: list[str] = []  # the files of the save being made that ``key_of`` knows
        self._lock = threading.Lock()

    def write(self, path: Path, pieces: list[Any], threads: int, written: Any = None) -> int:
        """``filewrite.write_file(path, pieces, ...)``, or a hard link to the previous checkpoint's identical file."""
        from automodel_ckpt.ondisk.fastio.filewrite import piece_length, write_file

        path = Path(path)
        rel = f"{path.parent.name}/{path.name}"  # the state folder and file: the same place in every checkpoint
        total = sum(piece_length(p) for p in pieces)
        try:
            key = content_key(pieces)
        except Exception:  # noqa: BLE001 - an unusual piece: written, never linked
            key = ""
        with self._lock:
            before = self._previous.get(rel)
        if key and before is not None and before.key == key and before.size == total and _link(before, path):
            if written is not None:
                written.note(path, synced=True, algorithm=before.algorithm, digest=before.digest)
            self._record(rel, replace(before, path=path))
            return total
        adopted = self._adopted
        if key and before is None and adopted is not None and _link_same_bytes(adopted / rel, path, total, key):
            if written is not None:
                written.note(path, synced=True)  # its checksum: hashed by the manifest, from the page cache
            st = os.stat(path)
            self._record(rel, _Kept(path, total, key, None, None, st.st_ino, st.st_mtime_ns))
            return total
        size = write_file(path, pieces, threads, written)
        known = written.get(path) if written is not None else None
        st = os.stat(path)
        self._record(rel, _Kept(path, size, key, known.algorithm if known else None, known.digest if known else None,
                                st.st_ino, st.st_mtime_ns))
        return size

    def _record(self, rel: str, kept: _Kept) -> None:
        with self._lock:
            self._current[rel] = kept
            if kept.key:
                where = os.path.abspath(kept.path)
                self._keyed.append(where)
                with _KEYS_LOCK:
                    _KEYS[where] = (kept.ino, kept.size, kept.mtime_ns, kept.key)

    def begin(self) -> None:
        """A new save starts (a save that was not published is forgotten: the previous one stays the reference)."""
        with self._lock:
            self._current = {}
            with _KEYS_LOCK:  # the last save's files were uploaded (or not) by now
                for where in self._keyed:
                    _KEYS.pop(where, None)
            self._keyed = []

    def adopt(self, folder: Path) -> None:
        """Before a resumed run's first save: compare with ``folder``, whose files are linked only once hashed."""
        with self._lock:
            if not self._previous:
                self._adopted = Path(folder)

    def published(self, staging: Path, final: Path) -> None:
        """The save written in ``staging`` is now the checkpoint ``final``: the next save compares with its files."""
        staging, final = Path(staging), Path(final)
        with self._lock:
            moved = {}
            for rel, kept in self._current.items():
                try:
                    inside = kept.path.relative_to(staging)
                except ValueError:
                    continue
                moved[rel] = replace(kept, path=final / inside)
            self._previous, self._current, self._adopted = moved, {}, None


def _link(before: _Kept, path: Path) -> bool:
    """Hard-link ``before.path`` (when it is still the file recorded) at ``path``; False where that cannot be done."""
    try:
        st = os.stat(before.path, follow_symlinks=False)
        if (st.st_ino, st.st_size, st.st_mtime_ns) != (before.ino, before.size, before.mtime_ns):
            return False
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.link(before.path, path, follow_symlinks=False)
        if os.stat(path, follow_symlinks=False).st_ino == before.ino:
            return True
        os.unlink(path)  # replaced between the check and the link: write it instead
    except OSError:  # no hard links here (another filesystem, EPERM, EMLINK), or the file is gone
        with contextlib.suppress(OSError):
            if os.path.lexists(path) and os.stat(path, follow_symlinks=False).st_ino == before.ino:
                os.unlink(path)
    return False


def _link_same_bytes(source: Path, path: Path, size: int, key: str) -> bool:
    """Hard-link ``source`` at ``path`` when it is a regular file of ``size`` bytes whose content hashes to ``key``
    (read back here), and is still that file once linked; False otherwise (nothing is left at ``path``)."""
    try:
        fd = paths.open_regular(source)
    except (OSError, ValueError):
        return False
    try:
        st = os.fstat(fd)
        if st.st_size != size:
            return False
        h = _hasher()
        while chunk := os.read(fd, _CHUNK):
            h.update(chunk)
        if h.hexdigest() != key:
            return False
    except OSError:
        return False
    finally:
        os.close(fd)
    return _link(_Kept(source, size, key, None, None, st.st_ino, st.st_mtime_ns), path)


def shared_bytes(folder: Path) -> tuple[int, int]:
    """``(own bytes, shared bytes)`` of the regular files below ``folder`` (shared: more than one link)."""
    stats = [st for _, st in paths.regular_stats(Path(folder))]
    shared = sum(st.st_size for st in stats if st.st_nlink > 1)
    return sum(st.st_size for st in stats) - shared, shared


def stored_once(folders: list[Path]) -> int:
    """Bytes the regular files below ``folders`` take, each file (inode) counted once however many links it has."""
    seen = {(st.st_dev, st.st_ino): st.st_size for folder in folders for _, st in paths.regular_stats(Path(folder))}
    return sum(seen.values())
