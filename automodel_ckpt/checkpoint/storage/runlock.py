"""One run per local checkpoint folder: an exclusive ``flock`` on ``<checkpoint_dir>/.run.lock`` for the run's life.

Two runs writing into one ``checkpoint_dir`` destroy each other's work: a save removes the ``.staging-*`` folders it
finds (they are leftovers of a killed run, unless another run is writing them), both move ``LATEST``, both prune.
So the run that owns the folder holds a lock on it from before its first write until training ends:

* rank 0 takes the lock (``hold``, collective) before any rank creates anything in the folder, and the other ranks
  learn the outcome from it: if the folder is taken, every rank raises the same one-line error naming the holder
  (host, pid, since when), which the lock file records;
* the lock is ``flock(LOCK_EX)`` on an open file: the kernel drops it when the holder's last descriptor closes, so
  a run that dies in any way (SIGKILL and the OOM killer included) never blocks the next one. A run that ends
  normally removes the file (``release``: at the end of training, else at exit); a killed one leaves it with stale contents, which the next run
  overwrites. A process forked by the holder (not ``exec``ed: the descriptor is close-on-exec) keeps the lock
  while it lives;
* within one process the lock is shared: a second ``RunLock`` on the same folder is the same run and counts up;
* the lock file is opened without following a link and without waiting on a FIFO: a symlink, FIFO or anything
  but a regular file in its place is refused in one line (remove it), never written through, truncated or
  deleted; the release removes the file only while it is still the one this run holds;
* reading verbs (``inspect``, ``verify``) take no lock; ``consolidate`` writes only its export folder, which
  replaces itself by rename, and takes none either.

Limits: ``flock`` is advisory (only this program's runs honour it) and per host on some network filesystems: NFS
(v4, or v3 with lockd) maps it to a byte-range lock that other clients see, Lustre only with the ``flock`` mount
option (``localflock`` makes it per node), and where the filesystem refuses locks (ENOLCK, EOPNOTSUPP) the run
warns and goes on without one. An object-store ``checkpoint_dir`` is locked through its local mirror folder here;
the bucket itself needs a lease (``objectstore``).
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import logging
import os
import socket
import stat
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from automodel_ckpt.distributed import collective
from automodel_ckpt.ondisk import layout, paths
from automodel_ckpt.distributed.lifeline import LAUNCHER_PID_ENV
from automodel_ckpt.errors import CheckpointError

logger = logging.getLogger(__name__)

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


class RunLock:
    """The lock of one checkpoint folder: ``acquire`` (or ``FolderInUseError`` naming the holder), ``release``,
    and ``holder`` (who has it, as recorded in the lock file). The same three calls fit a lease on an object store."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.path = self.folder / layout.RUN_LOCK
        self._mine = False  # whether this object counts in this process's hold

    @property
    def held(self) -> bool:
        return self._mine

    def acquire(self) -> None:
        """Take the folder for this run; ``FolderInUseError`` (one line naming the holder) if another run has it."""
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
        """Give the folder up (the last holder in this process removes the lock file). Idempotent."""
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
        """Who holds the lock (host, pid, since when), or None when nobody does. Never takes it; a lock file that
        is a symlink, FIFO or other non-regular file is refused (``CheckpointError``)."""
        try:
            fd = self._open(os.O_RDONLY)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno in _NOT_REGULAR:
                raise self._not_regular() from None
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return _describe(_read_holder(fd))
            except OSError:
                return None
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)

    def refuse_if_held(self) -> None:
        """``FolderInUseError`` if another run holds the folder now (a check before starting workers, which then
        take the lock themselves)."""
        who = self.holder()
        if who is not None:
            raise FolderInUseError(self._in_use(who))

    def _key(self) -> str:
        """This process's key for the lock: the lock file's path in the resolved folder (the folder is the user's
        to name, through links if they like; the lock file itself is never resolved)."""
        return os.path.join(os.path.realpath(self.folder), layout.RUN_LOCK)

    def _open(self, flags: int) -> int:
        """The lock file opened with ``flags``, never through a symlink nor waiting on a FIFO; ``OSError`` with
        errno ``ELOOP`` or ``EFTYPE``-like ``EINVAL`` when it is no regular file."""
        fd = os.open(self._key(), flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, "not a regular file", self._key())
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _not_regular(self) -> CheckpointError:
        try:
            kind = paths.not_regular(os.lstat(self.path).st_mode) or "not a regular file"
        except OSError:
            kind = "not a regular file"
        return CheckpointError(f"checkpoint.checkpoint_dir '{self.folder}': the run lock '{self.path}' is {kind}; "
                               "a run only locks a regular file of its own there: remove it and start again")

    def _in_use(self, who: str) -> str:
        return (f"checkpoint.checkpoint_dir '{self.folder}' is in use by another run ({who}); wait for it to end "
                f"or stop it, or choose another checkpoint.checkpoint_dir (lock: {self.path})")

    def _lock_file(self) -> int | None:
        """An open descriptor of the lock file, locked; None where the filesystem has no locks (with a warning)."""
        self.folder.mkdir(parents=True, exist_ok=True)
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
                who = _describe(_read_holder(fd))
                os.close(fd)
                raise FolderInUseError(self._in_use(who)) from None
            except OSError as exc:
                os.close(fd)
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
            os.close(fd)


def _drop(path: str, fd: int) -> None:
    """Remove the lock file, only if the name still is the very file ``fd`` holds (never a link or a file put in
    its place), then let the lock go."""
    try:
        if os.path.samestat(os.lstat(path), os.fstat(fd)):
            os.unlink(path)  # while still locked: a run that opened this file meanwhile retries on a new one
    except OSError:
        pass
    os.close(fd)


@atexit.register
def release_all() -> None:
    """At exit, whatever path the run ends by (short of being killed, when the kernel drops the lock anyway); a
    failed rank that leaves without exit handlers calls it itself."""
    with _MUTEX:
        for path, entry in _HELD.items():
            _drop(path, entry.fd)
        _HELD.clear()


def hold(folder: Path, rank: int) -> RunLock:
    """Collective: rank 0 takes ``folder`` for this run before any rank writes into it; if another run has it,
    every rank raises the same one-line ``FolderInUseError``. The other ranks' lock objects hold nothing."""
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
