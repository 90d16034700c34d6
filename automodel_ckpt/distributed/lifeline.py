"""Workers die with their launcher: a parent-death signal, and a watchdog on the launcher's pid as a fallback.

Why (torch's agent starts each worker in a session of its own) and the three guards: docs/security.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
from typing import MutableMapping

logger = logging.getLogger(__name__)

LAUNCHER_PID_ENV = "AUTOMODEL_CKPT_LAUNCHER_PID"
POLL_SECONDS = 0.5
_PR_SET_PDEATHSIG = 1

_bound: tuple[int, int] | None = None  # (launcher pid, parent pid when bound)
_HAS_PROC = os.path.isdir("/proc/self")
_children_bound = False
_forking: tuple[int, bool] = (0, False)  # (pid, from its main thread) of the process forking, set before each fork


def mark_launcher(environ: MutableMapping[str, str] = os.environ) -> None:
    """Launcher side: name this process as the launcher of the workers it is about to start."""
    environ[LAUNCHER_PID_ENV] = str(os.getpid())


def launcher_pid() -> int | None:
    """The pid of this worker's launcher: as the launcher named itself, or the parent torchrun; None elsewhere."""
    named = os.environ.get(LAUNCHER_PID_ENV, "")
    if named.isdigit():
        return int(named)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return os.getppid()
    return None


def bind_to_launcher() -> None:
    """Worker side, as early as possible: end this process when its launcher ends (no-op outside a launcher)."""
    global _bound
    if _bound is not None or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    launcher = launcher_pid()
    if launcher is None or launcher == os.getpid():
        return
    _arm_parent_death_signal()
    parent = os.getppid()  # after arming: a launcher that died before is seen here
    _bound = (launcher, parent)
    if launcher_gone():
        _stop("before this worker started")
    threading.Thread(target=_watch, name="ckpt-launcher-watchdog", daemon=True).start()


def launcher_gone() -> bool:
    """Whether this worker outlived its launcher (False when it has none)."""
    if _bound is None:
        return False
    launcher, parent = _bound
    return os.getppid() != parent or not alive(launcher)


def stop_if_orphaned(doing: str) -> None:
    """End this process now if its launcher is gone, instead of ``doing`` (e.g. "publishing 'epoch_0_step_8'")."""
    if launcher_gone():
        _stop(f"not {doing}")


def children_die_with_this_process() -> None:
    """Every process this one's main thread forks from now on ends when this process ends (an at-fork hook arms
    the parent-death signal; it follows the forking thread, so other threads' children are left as they are)."""
    global _children_bound
    if _children_bound or not hasattr(os, "register_at_fork") or _prctl() is None:
        return
    _children_bound = True
    os.register_at_fork(before=_before_fork, after_in_child=_die_with_parent)


def _before_fork() -> None:
    global _forking
    _forking = (os.getpid(), threading.current_thread() is threading.main_thread())


def _die_with_parent() -> None:
    parent, from_main_thread = _forking
    if not from_main_thread or _prctl_set_pdeathsig() != 0:
        return
    if os.getppid() != parent:  # the parent died before the signal was armed: as if it had been
        os.kill(os.getpid(), signal.SIGKILL)


def _watch() -> None:
    stop = threading.Event()
    while not stop.wait(POLL_SECONDS):
        if launcher_gone():
            _stop("stopping")


def _stop(why: str) -> None:
    launcher = _bound[0] if _bound else "?"
    with contextlib.suppress(OSError, ValueError):
        print(f"[pid {os.getpid()}] error: the launcher (pid {launcher}) is gone; {why}: this worker ends now",
              file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _arm_parent_death_signal() -> None:
    if _prctl() is not None and _prctl_set_pdeathsig() != 0:
        logger.debug("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())


_PRCTL: list = []  # [libc's prctl, or None]: looked up once, before any fork needs it


def _prctl():
    if not _PRCTL:
        prctl = None
        if sys.platform.startswith("linux"):
            with contextlib.suppress(OSError, AttributeError):  # no prctl: the watchdog alone guards
                prctl = ctypes.CDLL(None, use_errno=True).prctl
        _PRCTL.append(prctl)
    return _PRCTL[0]


def _prctl_set_pdeathsig() -> int:
    """``prctl(PR_SET_PDEATHSIG, SIGKILL)`` for this process: 0 when armed."""
    prctl = _prctl()
    return -1 if prctl is None else prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def proc_stat(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command's name (after its last ``)``: ``[0]`` the state, ``[1]``
    the parent's pid, ``[19]`` the start in clock ticks), or None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    _, paren, rest = data.rpartition(b")")
    return rest.decode("ascii", "replace").split() if paren else None


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    if _HAS_PROC:
        fields = proc_stat(pid)
        return bool(fields) and fields[0] not in ("Z", "X")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
