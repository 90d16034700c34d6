"""One run per local checkpoint folder: an exclusive ``flock`` on ``<checkpoint_dir>/.run.lock`` for the run's life.

Two runs writing into one ``checkpoint_dir`` destroy each other's work: a save removes the ``.staging-*`` folders it
finds (they are leftovers of a killed run, unless another run is writing them), both move ``LATEST``, both prune.
So the run that owns the folder holds a lock on it from before its first write until training ends:

* rank 0 takes the lock (``hold``, collective) before any rank creates anything in the folder, and the other ranks
  learn the outcome from it: if the folder is taken, every rank raises the same one-line error naming the holder
  (host, pid, since when), which the lock file records;
* the lock is ``flock(LOCK_EX)`` on an open file: the kernel drops it when the holder's last descriptor closes, so
  a run that dies in any way (SIGKILL and the OOM killer included) never blocks the next one. A run that ends
  normally removes the file (``release``: at the end of training, else at exit); a killed one leaves it with stale
  contents, which the next run overwrites;
* no other process ever holds the lock: the descriptor is close-on-exec, and a process forked by the holder (a
  DataLoader worker, any ``os.fork``) closes its copy first thing (``_forget_in_child``, an at-fork hook),
  so a rank's forked children, which may outlive it for a few seconds, never keep the folder taken;
* a run that finds the folder held by a killed run (the recorded holder, or its launcher, is dead on this host: what
  still holds the lock is a process it left behind, e.g. one ending after it) waits up to ``KILLED_RUN_WAIT_SECONDS``
  for the lock, saying so in one line, then takes it or is refused as below; a live holder is refused at once;
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
import contextlib
import errno
import fcntl
import json
import logging
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
_OPEN: set[int] = set()  # every descriptor of a lock file open in this process (a forked child closes them)
KILLED_RUN_WAIT_SECONDS = 15.0  # how long a run waits for what a killed run left holding the lock
_POLL_SECONDS = 0.05


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
        held, info = self._record()
        return _describe(info) if held else None

    def refuse_if_held(self) -> None:
        """``FolderInUseError`` if another run holds the folder now (a check before starting workers, which then
        take the lock themselves); what a killed run left holding it is waited for first (``_Wait``)."""
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
        """This process's key for the lock: the lock file's path in the resolved folder (the folder is the user's
        to name, through links if they like; the lock file itself is never resolved)."""
        return os.path.join(os.path.realpath(self.folder), layout.RUN_LOCK)

    def _open(self, flags: int) -> int:
        """The lock file opened with ``flags``, never through a symlink nor waiting on a FIFO; ``OSError`` with
        errno ``ELOOP`` or ``EFTYPE``-like ``EINVAL`` when it is no regular file."""
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
    """Remove the lock file, only if the name still is the very file ``fd`` holds (never a link or a file put in
    its place), then let the lock go."""
    with contextlib.suppress(OSError):
        if os.path.samestat(os.lstat(path), os.fstat(fd)):
            os.unlink(path)  # while still locked: a run that opened this file meanwhile retries on a new one
    _close(fd)


def _close(fd: int) -> None:
    _OPEN.discard(fd)
    os.close(fd)


def _forget_in_child() -> None:
    """In a process just forked (a DataLoader worker...): close its copies of the lock descriptors, so that only the
    run's own process ever holds the lock (closing a copy leaves the parent's lock as it is), and hold nothing."""
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
    """Waiting for what a killed run left holding the lock: ``on(record)`` says whether to try again (after a short
    pause, once the line saying so is printed) or to refuse: the holder is alive, or the wait is over."""

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
    """``pid P, launcher pid L`` when the record names a run of this host that was killed: its process, or its
    launcher, is gone (what holds the lock then is a process it left behind, ending too); None otherwise."""
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
