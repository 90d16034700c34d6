"""Opening a local file of a streamed corpus: only a regular file, checked before it is opened and again once open."""

from __future__ import annotations

import os
import stat
from typing import Any

from automodel_ckpt.ondisk import file_kind


class NotRegularFile(OSError):
    """A corpus path that is not a regular file once its links are resolved (a FIFO, a device, a socket)."""


def open_regular(path: str) -> Any:
    """A local file opened for reading in binary, if it is a regular file once its links are resolved:
    ``NotRegularFile`` otherwise, before anything opens it (opening a FIFO blocks, opening a device may act). The
    open itself never blocks, and the file opened must be the one checked (a swap in between is refused too)."""
    before = os.stat(path)  # follows links
    if not stat.S_ISREG(before.st_mode):
        raise NotRegularFile(f"{file_kind(before.st_mode)}, not a regular file; only regular files are read")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        after = os.fstat(fd)
        if not stat.S_ISREG(after.st_mode) or (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
            raise NotRegularFile("replaced while being opened, not the regular file listed; only regular files "
                                 "are read")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
