"""Durable filesystem steps: early writeback, fsync of files and folders, atomic pointer swaps, pointer resolution.

Our own files are created under a fresh name (``O_EXCL | O_NOFOLLOW``) and renamed over their place."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import secrets
import shutil
import stat
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from automodel_ckpt.ondisk import layout, paths


_NO_FOLLOW = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def fsync_file(path: Path) -> None:
    """fsync one of our regular files (a symlink is not followed, a FIFO not waited on: ``OSError``)."""
    fd = os.open(path, os.O_RDONLY | _NO_FOLLOW)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, text: str) -> None:
    """Write a small text file and fsync it: created beside ``path`` and renamed over it (``write_atomic``)."""
    write_atomic(Path(path), text.encode("utf-8"))


def write_json(path: Path, data: object) -> None:
    """Write a JSON file of ours (indent 2, keys sorted, final newline); not fsynced: its folder is, as a whole."""
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Put ``data`` at ``path``: written to a new file beside it (never through a link), fsynced, renamed over
    ``path``. Whatever was at ``path`` (a file, a symlink, a FIFO) is replaced, never written through."""
    with _replacing(path, mode) as fd:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]


def copy_regular(src: Path, dst: Path, *, follow: bool = False) -> None:
    """Copy the regular file ``src`` (a symlink only with ``follow``) to ``dst`` as ``write_atomic`` writes."""
    with os.fdopen(paths.open_regular(Path(src), follow=follow), "rb") as source, _replacing(dst) as fd:
        with os.fdopen(fd, "wb", closefd=False) as target:
            shutil.copyfileobj(source, target, 8 << 20)


@contextlib.contextmanager
def _replacing(path: Path, mode: int = 0o644) -> Iterator[int]:
    """The descriptor of a new file beside ``path``, fsynced and renamed over ``path`` (removed on failure)."""
    tmp = path.parent / f".{path.name}.tmp-{secrets.token_hex(6)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NO_FOLLOW, mode)
    try:
        try:
            yield fd
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _load_sync_file_range() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return lambda fd, offset, nbytes: fn(fd, offset, nbytes, 2)  # 2 = SYNC_FILE_RANGE_WRITE


_SYNC_FILE_RANGE = _load_sync_file_range()


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Start writing ``nbytes`` at ``offset`` of ``fd`` back now (``sync_file_range``); the fsync reports errors."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, offset, nbytes)


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (new names, renames) durable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems do not support fsync on folders
    finally:
        os.close(fd)


def files_under(root: Path) -> list[Path]:
    """The regular files below ``root``, reached without following a link."""
    return [Path(root) / rel for rel, _ in paths.walk_regular(root)]


@dataclass(frozen=True)
class _Written:
    """What the writer of a file recorded about it (``WrittenFiles.note``)."""

    synced: bool
    algorithm: str | None = None
    digest: str | None = None


def _stamp(path: Path) -> tuple[int, ...]:
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class WrittenFiles:
    """The files one ``Checkpointer`` wrote, fsynced or not, with their checksums while unchanged. Thread-safe."""

    def __init__(self) -> None:
        self._files: dict[str, tuple[tuple[int, ...], _Written]] = {}
        self._lock = threading.Lock()

    def note(self, path: Path, *, synced: bool, algorithm: str | None = None, digest: str | None = None) -> None:
        """Record, after closing ``path``, that it was fsynced (``synced``) and its checksum, if computed."""
        key = os.path.abspath(path)
        entry = (_stamp(Path(key)), _Written(synced, algorithm, digest))
        with self._lock:
            self._files[key] = entry

    def get(self, path: Path) -> _Written | None:
        """What ``note`` recorded for ``path``, if the file has not changed since."""
        key = os.path.abspath(path)
        with self._lock:
            entry = self._files.get(key)
        if entry is None:
            return None
        with contextlib.suppress(OSError):
            if _stamp(Path(key)) == entry[0]:
                return entry[1]
        with self._lock:
            self._files.pop(key, None)
        return None

    def forget(self, root: Path) -> None:
        """Drop the records of files below ``root`` (once they are no longer needed)."""
        prefix = os.path.join(os.path.abspath(root), "")
        with self._lock:
            self._files = {k: v for k, v in self._files.items() if not k.startswith(prefix)}


def fsync_tree(root: Path, rank: int = 0, world_size: int = 1, written: WrittenFiles | None = None) -> None:
    """fsync this rank's share of the files below ``root`` not synced yet, then (rank 0) every folder, deepest first."""
    todo = [path for path in files_under(root)[rank::world_size]
            if written is None or (known := written.get(path)) is None or not known.synced]
    if todo:
        with ThreadPoolExecutor(min(8, len(todo)), thread_name_prefix="ckpt-fsync") as pool:
            list(pool.map(fsync_file, todo))
    if rank == 0:
        dirs = sorted(paths.folders_under(root), key=lambda rel: rel.count("/"), reverse=True)
        for d in [*(Path(root) / rel for rel in dirs), Path(root)]:
            fsync_dir(d)


def set_pointer(checkpoint_dir: Path, pointer: str, target_name: str) -> None:
    """Point ``checkpoint_dir/pointer`` at ``target_name``: a relative symlink (else ``POINTER.txt``) renamed in."""
    checkpoint_dir = Path(checkpoint_dir)
    link = checkpoint_dir / pointer
    tmp = checkpoint_dir / f".{pointer}.tmp-{secrets.token_hex(6)}"
    try:
        os.symlink(target_name, tmp)
        os.replace(tmp, link)
        text = checkpoint_dir / layout.pointer_text_file(pointer)
        if os.path.lexists(text):
            text.unlink()
    except OSError:
        if tmp.is_symlink():
            tmp.unlink()
        write_atomic(checkpoint_dir / layout.pointer_text_file(pointer), (target_name + "\n").encode("utf-8"))
    fsync_dir(checkpoint_dir)


def read_pointer(checkpoint_dir: Path, pointer: str) -> str | None:
    """The name a pointer targets (symlink first, then the .txt fallback), or None when it has none."""
    link = Path(checkpoint_dir) / pointer
    if link.is_symlink():
        return Path(os.readlink(link)).name
    text = Path(checkpoint_dir) / layout.pointer_text_file(pointer)
    if text.exists():
        try:
            name = paths.read_text(text).strip()
        except (OSError, ValueError):  # not a regular file, not UTF-8: designates nothing
            return None
        return name or None
    return None


def remove_pointer(checkpoint_dir: Path, pointer: str) -> None:
    """Remove a pointer (symlink and .txt fallback), e.g. when the checkpoint it named was quarantined."""
    checkpoint_dir = Path(checkpoint_dir)
    for path in (checkpoint_dir / pointer, checkpoint_dir / layout.pointer_text_file(pointer)):
        if path.is_symlink() or path.exists():
            path.unlink()
    fsync_dir(checkpoint_dir)


def remove_tree(path: Path) -> None:
    """Remove a folder of ours and everything below it, following no link (a symlink in its place is removed)."""
    path = Path(path)
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        with contextlib.suppress(OSError):
            path.unlink()
        return
    shutil.rmtree(path, ignore_errors=True)  # rmtree never follows a link below the top


def replace_folder(tmp: Path, out: Path, old_name: str) -> None:
    """Rename ``tmp`` to ``out``, an existing ``out`` moved aside to ``old_name`` (restored on failure) and deleted."""
    out = Path(out)
    old = None
    if out.exists() or out.is_symlink():
        old = out.parent / old_name
        os.rename(out, old)
    try:
        os.rename(tmp, out)
    except OSError:
        if old is not None:
            os.rename(old, out)
        raise
    fsync_dir(out.parent)
    if old is not None:
        remove_tree(old)


def unwritable(folder: Path) -> str | None:
    """Create ``folder`` if needed and prove a file can be created in it; the problem if not (read-only, ...)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        return (f"checkpoint.checkpoint_dir: cannot write to '{folder}' ({exc.strerror or type(exc).__name__}); "
                "choose a writable folder or set checkpoint.enabled: false")
    return None
