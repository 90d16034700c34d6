"""One run per local checkpoint folder: an exclusive ``flock`` on ``<checkpoint_dir>/.run.lock`` for the run's life.

Two runs in one folder would remove each other's staging folders, move each other's ``LATEST`` and prune. Rank 0
takes the lock before any rank writes (``hold``, collective) and records its holder; the kernel drops it however
the holder dies, and no forked child keeps it (close-on-exec, ``_forget_in_child``). What a killed run left holding
it is waited for up to ``KILLED_RUN_WAIT_SECONDS``. Within one process it is shared and counted. The lock file is
never opened through a link or a FIFO. Its limits (advisory, per host on some network filesystems) are in
docs/checkpointing.md; an object store's bucket needs a lease (``objectstore``).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from automodel_ckpt.distributed import collective
from automodel_ckpt.ondisk import layout, paths
from automodel_ckpt.distributed.lifeline import LAUNCHER_PID_ENV, alive as _alive
from automodel_ckpt.errors import CheckpointError


_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
_NOT_REGULAR = (errno.ELOOP, errno.EINVAL, errno.ENXIO, errno.EISDIR, errno.ENOTDIR)  # a link, FIFO, folder...


class FolderInUseError(CheckpointError):
    """Another run holds the checkpoint folder's lock."""


@dataclass
class _Held:
    fd: int
    count: int


_HELD: dict[str, _Held] = {}  # this process's locks, by the lock file's real path
_MUTEX = threading.Lock()
_OPEN: set[int] = set()  # every descriptor of a lock file open in this process (a forked child closes them)
KILLED_RUN_WAIT_SECONDS = 15.0  # how long a run waits for what a killed run left holding the lock
_POLL_SECONDS = 0.05


class RunLock:
    """The lock of one checkpoint folder: ``acquire``, ``release``, ``holder``, the same calls as a store's lease."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.path = self.folder / layout.RUN_LOCK
        self._mine = False  # whether this object counts in this process's hold

    @property
    def held(self) -> bool:
        return self._mine

    def acquire(self) -> None:
        if self._mine:
            return
        key = self._key()
        with _MUTEX:
            held = _HELD.get(key)
            if held is not None:  # this process already holds it: the same run
                held.count += 1
                self._mine = True
                return
            fd = self._lock_file()
            if fd is not None:
                _write_holder(fd)
                _HELD[key] = _Held(fd, 1)
            self._mine = True

    def release(self) -> None:
        """Idempotent; the last holder in this process removes the lock file."""
        if not self._mine:
            return
        self._mine = False
        key = self._key()
        with _MUTEX:
            held = _HELD.get(key)
            if held is None:
                return
            held.count -= 1
            if held.count > 0:
                return
            del _HELD[key]
            _drop(key, held.fd)

    def holder(self) -> str | None:
        """Who holds the lock (host, pid, since when), or None; never takes it."""
        held, info = self._record()
        return _describe(info) if held else None

    def refuse_if_held(self) -> None:
        """The launcher's check before starting workers (which take the lock themselves)."""
        waiting = _Wait(self.folder)
        while True:
            held, info = self._record()
            if not held:
                return
            if not waiting.on(info):
                raise FolderInUseError(self._in_use(_describe(info), waiting))

    def _record(self) -> tuple[bool, dict | None]:
        """Whether another open file holds the lock, and the holder's record. Never takes it."""
        try:
            fd = self._open(os.O_RDONLY)
        except FileNotFoundError:
            return False, None
        except OSError as exc:
            if exc.errno in _NOT_REGULAR:
                raise self._not_regular() from None
            return False, None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return True, _read_holder(fd)
            except OSError:
                return False, None
            fcntl.flock(fd, fcntl.LOCK_UN)
            return False, None
        finally:
            _close(fd)

    def _key(self) -> str:
        """The lock file's path in the resolved folder (the folder may be named through links, the file never)."""
        return os.path.join(os.path.realpath(self.folder), layout.RUN_LOCK)

    def _open(self, flags: int) -> int:
        """The lock file opened never through a symlink nor waiting on a FIFO; ``OSError`` if not a regular file."""
        fd = os.open(self._key(), flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        _OPEN.add(fd)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, "not a regular file", self._key())
            os.set_blocking(fd, True)
        except BaseException:
            _close(fd)
            raise
        return fd

    def _not_regular(self) -> CheckpointError:
        try:
            kind = paths.not_regular(os.lstat(self.path).st_mode) or "not a regular file"
        except OSError:
            kind = "not a regular file"
        return CheckpointError(f"checkpoint.checkpoint_dir '{self.folder}': the run lock '{self.path}' is {kind}; "
                               "a run only locks a regular file of its own there: remove it and start again")

    def _in_use(self, who: str, waiting: _Wait | None = None) -> str:
        held = f" and still holds it after {waiting.seconds:.0f} s" if waiting is not None and waiting.started else ""
        return (f"checkpoint.checkpoint_dir '{self.folder}' is in use by another run ({who}){held}; wait for it to "
                f"end or stop it, or choose another checkpoint.checkpoint_dir (lock: {self.path})")

    def _lock_file(self) -> int | None:
        """An open descriptor of the lock file, locked; None where the filesystem has no locks (with a warning)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        waiting = _Wait(self.folder)
        while True:
            try:
                fd = self._open(os.O_RDWR | os.O_CREAT)
            except OSError as exc:
                if exc.errno in _NOT_REGULAR:
                    raise self._not_regular() from None
                raise
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                info = _read_holder(fd)
                _close(fd)
                if waiting.on(info):
                    continue
                raise FolderInUseError(self._in_use(_describe(info), waiting)) from None
            except OSError as exc:
                _close(fd)
                if exc.errno not in _UNSUPPORTED:
                    raise
                warnings.warn(f"checkpoint.checkpoint_dir '{self.folder}': the filesystem refuses file locks "
                              f"({exc.strerror}); nothing stops a second run from using this folder", stacklevel=4)
                return None
            try:  # the file may have been removed (and replaced) by a holder releasing it while we opened it
                same = os.path.samestat(os.fstat(fd), os.lstat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                return fd
            _close(fd)


def _drop(path: str, fd: int) -> None:
    """Remove the lock file only while the name is still the file ``fd`` holds, then let the lock go."""
    with contextlib.suppress(OSError):
        if os.path.samestat(os.lstat(path), os.fstat(fd)):
            os.unlink(path)  # while still locked: a run that opened this file meanwhile retries on a new one
    _close(fd)


def _close(fd: int) -> None:
    _OPEN.discard(fd)
    os.close(fd)


def _forget_in_child() -> None:
    """In a forked child (a DataLoader worker): close its copies of the lock descriptors (the parent keeps the lock)."""
    global _MUTEX
    _MUTEX = threading.Lock()  # another thread of the parent may have held it at the fork
    for fd in set(_OPEN) | {held.fd for held in _HELD.values()}:
        with contextlib.suppress(OSError):
            os.close(fd)
    _OPEN.clear()
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


class _Wait:
    """Waiting for what a killed run left holding the lock: ``on(record)`` is whether to try again."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.seconds = folder, KILLED_RUN_WAIT_SECONDS
        self.started: float | None = None

    def on(self, info: dict | None) -> bool:
        killed = _killed(info)
        if killed is None:
            return False
        now = time.monotonic()
        if self.started is None:
            self.started = now
            print(f"checkpoint.checkpoint_dir '{self.folder}': waiting for the workers of a killed run ({killed}) "
                  f"to exit (up to {self.seconds:.0f} s)", file=sys.stderr, flush=True)
        elif now - self.started >= self.seconds:
            return False
        time.sleep(_POLL_SECONDS)  # polling the lock: it is free once the last of those processes has ended
        return True


def _killed(info: dict | None) -> str | None:
    """``pid P, launcher pid L`` when the record names a run of this host whose process or launcher is gone."""
    if not info or info.get("host") != socket.gethostname():
        return None
    pid, launcher = info.get("pid"), info.get("launcher_pid")
    if not isinstance(pid, int) or pid <= 0 or not (launcher is None or isinstance(launcher, int) and launcher > 0):
        return None
    if _alive(pid) and (launcher is None or _alive(launcher)):
        return None
    return f"pid {pid}" + (f", launcher pid {launcher}" if launcher else "")


@atexit.register
def release_all_locks() -> None:
    """At exit; a failed rank that leaves without exit handlers calls it itself."""
    with _MUTEX:
        for path, entry in _HELD.items():
            _drop(path, entry.fd)
        _HELD.clear()


def hold(folder: Path, rank: int) -> RunLock:
    """Collective: rank 0 takes ``folder`` before any rank writes; if taken, every rank raises ``FolderInUseError``."""
    lock = RunLock(folder)

    def take() -> str | None:
        try:
            lock.acquire()
        except FolderInUseError as exc:
            return str(exc)
        return None

    problem = collective.on_main(take, "locking the checkpoint folder", rank)
    if problem:
        raise FolderInUseError(problem)
    return lock


def _describe(info: dict | None) -> str:
    """``host H, pid P (launcher pid L), since 2026-01-31 12:00:00 UTC`` from the lock file's record."""
    if not info:
        return "holder not recorded yet: it is starting"
    parts = [f"host {info.get('host', '?')}", f"pid {info.get('pid', '?')}"]
    if info.get("launcher_pid"):
        parts[-1] += f" (launcher pid {info['launcher_pid']})"
    since = info.get("since")
    if isinstance(since, (int, float)):
        parts.append("since " + time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(since)))
    return ", ".join(parts)


def _write_holder(fd: int) -> None:
    info = {"host": socket.gethostname(), "pid": os.getpid(), "since": round(time.time(), 3),
            "launcher_pid": int(os.environ[LAUNCHER_PID_ENV]) if os.environ.get(LAUNCHER_PID_ENV, "").isdigit() else None}
    data = (json.dumps(info) + "\n").encode("utf-8")
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


def _read_holder(fd: int) -> dict | None:
    try:
        data = os.pread(fd, 4096, 0)
        info = json.loads(data.decode("utf-8")) if data.strip() else None
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None
