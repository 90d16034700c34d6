"""One run at a time on an object-store run folder: a lease object with its holder, a heartbeat and an expiry.

A second run is refused naming the holder, unless the lease expired or its holder is a gone process of this machine;
with no compare-and-swap on S3, its limits are docs/object-storage.md's.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from datetime import datetime, timezone
from typing import Any, Callable

from automodel_ckpt.distributed.lifeline import alive, proc_stat
from automodel_ckpt.ondisk import bounded, layout
from automodel_ckpt.checkpoint.objectstore.store import ObjectStore, wrap
from automodel_ckpt.errors import CheckpointError

logger = logging.getLogger(__name__)

_HEARTBEAT_SECONDS = 30.0  # how often the holder rewrites the lease
_EXPIRY_SECONDS = 180.0  # a lease not rewritten for this long is free


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _process_start(pid: int) -> str:
    """When process ``pid`` started (clock ticks since boot, from /proc), or "" where that cannot be read."""
    fields = proc_stat(pid) or []
    return fields[19] if len(fields) > 19 and fields[0] != "Z" else ""  # a zombie has ended


def me() -> dict[str, Any]:
    """This process as a lease holder: host, boot, pid namespace, pid and its start (a reused pid apart)."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "boot_id": _boot_id(), "pid_ns": _pid_namespace(), "pid": pid,
            "pid_start": _process_start(pid)}


def _holder_is_gone(holder: dict[str, Any]) -> bool:
    """Whether ``holder`` was a process of this machine (same host, boot and pid namespace) that no longer runs."""
    here = me()
    if not holder.get("boot_id") or any(holder.get(k) != here[k] for k in ("host", "boot_id", "pid_ns")):
        return False  # another machine or container (or unknown): only expiry frees it
    try:
        pid = int(holder.get("pid", 0))
    except (TypeError, ValueError):
        return False
    if pid <= 0:
        return False
    started = _process_start(pid)
    if started:
        return bool(holder.get("pid_start")) and started != holder.get("pid_start")  # the pid was reused
    # no start read from /proc: no such process, or one that has ended (a zombie); without /proc, the kernel says
    return os.path.isdir("/proc/self") or not alive(pid)


def _when(stamp: float) -> str:
    return datetime.fromtimestamp(stamp, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


class Lease:
    """The lease on ``store``'s run folder. ``clock``: seconds since the epoch (injectable for tests)."""

    def __init__(self, store: ObjectStore, key: str = "checkpoint.checkpoint_dir", *,
                 clock: Callable[[], float] = time.time, expiry: float = _EXPIRY_SECONDS,
                 heartbeat: float = _HEARTBEAT_SECONDS) -> None:
        self.store, self.key, self.clock, self.expiry, self.heartbeat = store, key, clock, expiry, heartbeat
        self.token = uuid.uuid4().hex
        self.holder = me()
        self.started = clock()
        self.held = False
        self.lost: dict[str, Any] | None = None  # the lease that replaced ours, once seen
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- the object ------------------------------------------------------------------------------------
    def read(self) -> dict[str, Any] | None:
        """The lease object now (None when there is none; a damaged one reads as expired)."""
        text = wrap(f"reading the lease of '{self.store.url}'", lambda: self.store.read_text(layout.LEASE_OBJECT))
        if text is None:
            return None
        try:
            data = bounded.parse_json(text, f"the lease of '{self.store.url}'", "a lease", bounded.SMALL_FILE_LIMIT)
            if not isinstance(data, dict) or not isinstance(data.get("holder"), dict):
                raise ValueError("not a lease")
            float(data["expires"]), float(data["renewed"]), float(data["since"])
            return data
        except (ValueError, KeyError, TypeError, CheckpointError):
            return {"token": "", "holder": {}, "since": 0.0, "renewed": 0.0, "expires": 0.0}

    def _write(self) -> None:
        now = self.clock()
        body = {"token": self.token, "holder": self.holder, "since": self.started, "renewed": now,
                "expires": now + self.expiry}
        wrap(f"writing the lease of '{self.store.url}'",
             lambda: self.store.write_text(json.dumps(body) + "\n", layout.LEASE_OBJECT))

    def free(self, lease: dict[str, Any]) -> bool:
        """Whether another holder's ``lease`` may be taken over: expired, or its process is gone."""
        return self.clock() >= float(lease["expires"]) or _holder_is_gone(lease["holder"])

    def describe(self, lease: dict[str, Any]) -> str:
        h = lease["holder"]
        return (f"host {h.get('host', '?')}, pid {h.get('pid', '?')}, since {_when(float(lease['since']))} "
                f"(last heartbeat {max(0.0, self.clock() - float(lease['renewed'])):.0f} s ago, expires in "
                f"{max(0.0, float(lease['expires']) - self.clock()):.0f} s)")

    def _in_use(self, lease: dict[str, Any]) -> CheckpointError:
        return CheckpointError(
            f"{self.key}: '{self.store.url}' is in use by another run: {self.describe(lease)}; wait for it to end "
            f"(or, if it is dead, for the lease to expire, or remove it with `ckpt-train gc {self.store.url} "
            "--break-lease`)")

    # --- the holder's life ---------------------------------------------------------------------------
    def acquire(self) -> None:
        """Take the lease, or raise ``CheckpointError`` (one line) naming the live holder."""
        current = self.read()
        if current is not None and current.get("token") != self.token and not self.free(current):
            raise self._in_use(current)
        if current is not None and current.get("token") != self.token and current.get("token"):
            logger.warning("taking over the lease of %s from %s", self.store.url, self.describe(current))
        self._write()
        back = self.read()
        if back is None or back.get("token") != self.token:  # another run wrote in between: it holds it
            raise self._in_use(back) if back else CheckpointError(
                f"{self.key}: the lease of '{self.store.url}' vanished while it was taken; is another run starting?")
        self.held = True

    def renew(self) -> bool:
        """One heartbeat: rewrite the lease if it is still ours; False (and ``lost`` set) once another holds it."""
        if not self.held:
            return False
        current = self.read()
        if current is None or current.get("token") != self.token:
            self.lost = current or {"token": "", "holder": {}, "since": 0.0, "renewed": 0.0, "expires": 0.0}
            self.held = False
            logger.error("the lease of %s was removed or taken by another run; this run saves nothing more",
                         self.store.url)
            return False
        self._write()
        return True

    def start_heartbeat(self) -> None:
        """Renew every ``heartbeat`` seconds on a daemon thread until ``release`` (store errors are retried)."""
        def beat() -> None:
            while not self._stop.wait(self.heartbeat):
                try:
                    if not self.renew():
                        return
                except CheckpointError as exc:  # a network blip: try again at the next beat
                    logger.warning("lease heartbeat failed (retrying): %s", exc)

        self._thread = threading.Thread(target=beat, name="object-store-lease", daemon=True)
        self._thread.start()

    def check(self) -> None:
        """Before a save: ``CheckpointError`` if the lease was taken by another run (then this run must not save)."""
        if self.lost is not None:
            who = self.describe(self.lost) if self.lost.get("holder") else "removed"
            raise CheckpointError(f"{self.key}: this run lost the lease of '{self.store.url}' ({who}); it saves "
                                  "nothing more: two runs must not write one run folder")

    def release(self) -> None:
        """Stop the heartbeat and remove the lease if it is still ours (clean exit)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        if not self.held:
            return
        self.held = False
        try:
            current = self.read()
            if current is not None and current.get("token") == self.token:
                self.store.remove(layout.LEASE_OBJECT)
        except Exception as exc:  # noqa: BLE001 - at exit: the lease then expires on its own
            logger.warning("could not remove the lease of %s (it expires in %.0f s): %s", self.store.url,
                           self.expiry, exc)


def break_lease(store: ObjectStore) -> dict[str, Any] | None:
    """Remove the lease of ``store``'s run folder whoever holds it; returns what it was (None when there was none)."""
    lease = Lease(store, "gc").read()
    if lease is not None:
        wrap(f"removing the lease of '{store.url}'", lambda: store.remove(layout.LEASE_OBJECT))
    return lease
