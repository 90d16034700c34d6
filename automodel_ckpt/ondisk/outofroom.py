"""A write that runs out of room (ENOSPC, EDQUOT, a read-only filesystem) as one line: folder, bytes needed, free.

Recognised by an ``OSError``'s ``errno`` in the chain, or (failures reach other ranks as text) its message."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

from automodel_ckpt.errors import DiskFullError
from automodel_ckpt.sizes import human_size

_OUT_OF_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)
_REASONS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
            errno.EROFS: "the filesystem is read-only"}
_TEXTS = {os.strerror(code).lower(): code for code in _OUT_OF_ROOM}


def out_of_room(exc: BaseException | None) -> int | None:
    """The errno (ENOSPC, EDQUOT or EROFS) behind ``exc``, or None when the failure is something else."""
    seen: set[int] = set()
    todo: list[Any] = [exc]
    while todo:
        item = todo.pop()
        if item is None or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, tuple):
            todo.extend(item)
            continue
        if not isinstance(item, BaseException):
            continue
        if isinstance(item, DiskFullError):
            return item.errno
        if isinstance(item, OSError) and item.errno in _OUT_OF_ROOM:
            return item.errno
        failures = getattr(item, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):
            todo.extend(failures.values())
        todo.extend([item.__cause__, item.__context__])
        try:
            text = str(item).lower()
        except Exception:  # noqa: BLE001 - an exception whose __str__ fails says nothing
            continue
        for words, code in _TEXTS.items():
            if words in text:
                return code
    return None


def tree_bytes(root: Path) -> int:
    """The bytes of the files below ``root`` (0 if it is gone)."""
    total = 0
    for folder, _, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                continue
    return total


def free_bytes(folder: Path) -> int | None:
    """Free bytes on the filesystem holding ``folder`` (or its nearest existing parent)."""
    folder = Path(folder).absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def message(code: int, what: str, folder: Path, needed: int | None, free: int | None, then: str) -> str:
    """``<what> in '<folder>' failed: <reason> (needs about N, M free there); <then>``, one line."""
    sizes = []
    if needed:
        sizes.append(f"needs about {human_size(needed)}")
    if free is not None:
        sizes.append(f"{human_size(free)} free there")
    detail = f" ({', '.join(sizes)})" if sizes else ""
    fix = ("remount it writable or choose another folder" if code == errno.EROFS
           else "free space (or raise the quota) or choose a folder on a larger filesystem")
    return f"{what} in '{folder}' failed: {_REASONS[code]}{detail}; {fix}; {then}"


def export_error(exc: BaseException, out_dir: Path, needed: int | None) -> BaseException:
    """An export's failure: a one-line ``DiskFullError`` if it ran out of room, else ``exc`` unchanged."""
    code = out_of_room(exc)
    if code is None or isinstance(exc, DiskFullError):
        return exc
    err = DiskFullError(message(code, "writing the Hugging Face export", Path(out_dir).parent, needed,
                                free_bytes(out_dir), f"its temporary folder was removed, '{out_dir}' is unchanged"))
    err.errno = code
    err.__cause__ = exc
    return err
