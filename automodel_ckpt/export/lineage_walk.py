"""`inspect --lineage`: a record's parents walked by identity (device and inode), each read once, in bounded work.

A record and every path it names are data: a parent is looked at on disk only when it is what a parent can be (a
checkpoint or its ``model/``, an export folder, an export target's file, an archive) on an ordinary filesystem,
reached without a link; anything else is named with what it is and never opened (``parent_problem``). A record that
names itself, however spelled, is a cycle. Each cap (``READ_LIMIT``, ``MAX_PARENTS``, ``MAX_DEPTH``) is said in one
line when reached; docs/inspect-and-diff.md#lineage shows a listing.
"""

from __future__ import annotations

import functools
import os
import stat
from pathlib import Path
from typing import Any

from automodel_ckpt.errors import CheckpointError
from automodel_ckpt.export.lineage import Reads, ReadsSpent, lineage_fingerprint, read_lineage
from automodel_ckpt.export.registry import export_targets
from automodel_ckpt.ondisk import Archive, CheckpointFolder, HFFolder, MiB, file_kind
from automodel_ckpt.shown import one_line
from automodel_ckpt.sizes import human_size

MAX_DEPTH = 32  # generations printed
MAX_PARENTS = 1024  # parent entries one listing prints
MAX_LISTED = 256  # parents of one record listed
READ_LIMIT = 2048 * MiB  # bytes one listing reads of the parents it meets (fingerprints and records)
#: The kernel's own filesystems: nothing on them is a checkpoint, and reading some of them blocks or leaks.
_SYSTEM_FILESYSTEMS = frozenset({"proc", "sysfs", "devtmpfs", "devpts", "debugfs", "tracefs", "securityfs", "cgroup",
                                 "cgroup2", "configfs", "fusectl", "bpf", "pstore", "efivarfs", "mqueue",
                                 "binfmt_misc", "autofs", "rpc_pipefs", "nsfs", "selinuxfs", "hugetlbfs"})
_SYSTEM_DIRS = ("/proc", "/sys", "/dev")
#: A folder holding one of these as a regular file is a checkpoint or an export folder.
_MARKERS = (CheckpointFolder.metadata, HFFolder.lineage, HFFolder.config, HFFolder.adapter_config)


def lineage_chain(target: str | Path) -> list[str]:
    """The lines of ``inspect --lineage``: ``target`` and each generation of parents below it, indented, with
    fingerprints and whether each parent is still there; every value escaped."""
    target = Path(target)
    walk = _Walk(Reads(READ_LIMIT))
    record = read_lineage(target, follow=True, reads=walk.reads)  # the path the user named
    try:
        own = lineage_fingerprint(target, follow=True, reads=walk.reads)
    except ReadsSpent:
        own = None
    walk.lines.append(one_line(f"lineage of '{target}'" + (f" ({own})" if own else "")))
    if record is None:
        return walk.lines + ["  no lineage recorded (written before lineage was, or not by ckpt-train)"]
    try:
        st = os.stat(target)
        root: frozenset[Any] = frozenset({(st.st_dev, st.st_ino)})
    except OSError:
        root = frozenset()
    walk.parents(record, 1, root)
    return walk.lines


class _Walk:
    """One listing: its lines, its reads, the parents whose parents are listed already and how many were listed."""

    def __init__(self, reads: Reads) -> None:
        self.reads = reads
        self.lines: list[str] = []
        self.expanded: set[Any] = set()
        self.listed = 0
        self.full = False  # MAX_PARENTS listed: nothing more is

    def add(self, depth: int, text: str) -> None:
        self.lines.append("  " * depth + one_line(text))

    def parents(self, record: dict[str, Any], depth: int, ancestors: frozenset[Any]) -> None:
        """``record``'s parents at ``depth``, each followed by its own. ``ancestors``: the identities on the way down
        (one again is a cycle, not followed); a parent in ``expanded`` (a shared base model) lists its parents once."""
        if self.full:
            return
        if depth > MAX_DEPTH:
            self.add(depth, f"... (more than {MAX_DEPTH} generations: not shown)")
            return
        stage = record.get("stage")
        if isinstance(stage, dict):  # a run in stages (docs/stages.md): a change names the stage before
            after = f", after stage {stage['after']} of its parent: a stage change" if stage.get("after") else ""
            self.add(depth, f"stage: {stage.get('name')} (from step {stage.get('first_step')}{after})")
        parents = record.get("parents") or []
        if not isinstance(parents, list):
            self.add(depth, "(parents that are no list)")
            parents = []
        for entry in parents[:MAX_LISTED]:
            if self.listed >= MAX_PARENTS:
                self.full = True
                self.add(depth, f"... (more than {MAX_PARENTS} parents: the rest not shown)")
                return
            self.listed += 1
            self.entry(entry, depth, ancestors)
            if self.full:
                return
        if len(parents) > MAX_LISTED:
            self.add(depth, f"... ({len(parents) - MAX_LISTED} more parents of this record: not shown)")
        data = record.get("data")
        if isinstance(data, dict):
            rows = f", rows {data['rows']}" if data.get("rows") else ""
            self.add(depth, f"training data: {data.get('fingerprint')}{rows}")

    def entry(self, entry: Any, depth: int, ancestors: frozenset[Any]) -> None:
        if not isinstance(entry, dict):
            self.add(depth, "(an entry that is no parent)")
            return
        status, identity = self.status(entry)
        extra = "".join(f", {k} {entry[k]}" for k in ("trainer", "step") if entry.get(k) is not None)
        self.add(depth, f"{entry.get('role', 'parent')}: {entry.get('path') or entry.get('checkpoint')} "
                        f"({entry.get('fingerprint') or 'no fingerprint'}{extra}) [{status}]")
        key = identity if identity is not None else ("path", str(entry.get("path") or id(entry)))
        if key in ancestors:
            self.add(depth + 1, "(its own ancestor: a cycle, not followed)")
            return
        if key in self.expanded:
            self.add(depth + 1, "(its parents are listed above)")
            return
        below = entry.get("lineage")
        if identity is not None and not isinstance(below, dict):
            try:
                below = read_lineage(Path(entry["path"]), reads=self.reads)
            except CheckpointError as exc:
                self.add(depth + 1, str(exc))
                below = None
            except ReadsSpent:
                self.add(depth + 1, f"(its lineage is not read: this listing has read its {self.limit})")
                below = None
        if isinstance(below, dict):
            self.expanded.add(key)
            self.parents(below, depth + 1, ancestors | {key})

    @property
    def limit(self) -> str:
        return human_size(self.reads.limit)

    def status(self, entry: dict[str, Any]) -> tuple[str, tuple[int, int] | None]:
        """How ``entry``'s path is now ("present", "gone", "changed: now ...", or why it is not read) and its
        identity (device, inode) when it may be read (``parent_problem``); None: named, not read."""
        path = entry.get("path")
        if not isinstance(path, str) or not path:
            return "recorded in the archive", None
        try:
            st = os.lstat(path)
        except (OSError, ValueError):
            return "gone", None
        why = parent_problem(Path(path), st)
        if why is not None:
            return why, None
        identity = (st.st_dev, st.st_ino)
        recorded = entry.get("fingerprint")
        if recorded is None:
            return "present", identity
        try:
            now = lineage_fingerprint(path, reads=self.reads)
        except ReadsSpent:
            return f"present; not compared or followed: this listing has read its {self.limit}", None
        if now is None or now == recorded:
            return "present", identity
        return f"changed: now {now}", identity


def parent_problem(path: Path, st: os.stat_result) -> str | None:
    """Why the parent at ``path`` (``st``: its ``lstat``) is named but not read, or None: it is read (a file named as
    an export target's or an archive is, and its contents then say whether it is one)."""
    mode = st.st_mode
    if stat.S_ISLNK(mode):
        return "a link: not followed"
    if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
        return f"{file_kind(mode)}, not a folder or file: not read"
    if _on_system_filesystem(path, st):
        return "on a filesystem of the kernel's (/proc, /sys, /dev): not read"
    if stat.S_ISDIR(mode):
        return None if _is_model_folder(path) else "a folder that is no checkpoint or export: not read"
    files = [t for t in export_targets() if t.suffix]
    if path.name.endswith((*(t.suffix for t in files), Archive.SUFFIX)):
        return None
    kinds = "".join(f"{t.noun.partition(' ')[2]} ({t.suffix}) or " for t in files)
    return f"a file that is no {kinds}archive ({Archive.SUFFIX}): not read"


def _is_model_folder(path: Path) -> bool:
    """A checkpoint or an export folder (one of ``_MARKERS`` a regular file in it), or a checkpoint's ``model/``."""
    def regular(file: Path) -> bool:
        try:
            return stat.S_ISREG(os.lstat(file).st_mode)
        except OSError:
            return False

    if any(regular(path / name) for name in _MARKERS):
        return True
    return path.name == CheckpointFolder.model and regular(path / ".." / CheckpointFolder.metadata)


def _on_system_filesystem(path: Path, st: os.stat_result) -> bool:
    """Whether ``path``'s device is a kernel filesystem's, or its real path is below one of ``_SYSTEM_DIRS``."""
    if st.st_dev in _system_devices():
        return True
    real = os.path.realpath(path)
    return any(real == top or real.startswith(top + "/") for top in _SYSTEM_DIRS)


@functools.lru_cache(maxsize=1)
def _system_devices() -> frozenset[int]:
    """The devices of ``_SYSTEM_DIRS`` and of every mount of ``_SYSTEM_FILESYSTEMS`` in this process's mount table."""
    devices = set()
    for top in _SYSTEM_DIRS:
        try:
            devices.add(os.stat(top).st_dev)
        except OSError:
            continue
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            table = f.read(16 * MiB).decode("utf-8", "replace")
    except OSError:
        return frozenset(devices)
    for line in table.splitlines():
        fields, _, rest = line.partition(" - ")
        numbers, kind = fields.split()[2:3], rest.split()[:1]
        if numbers and kind and kind[0] in _SYSTEM_FILESYSTEMS and numbers[0].count(":") == 1:
            major, minor = numbers[0].split(":")
            if major.isdigit() and minor.isdigit():
                devices.add(os.makedev(int(major), int(minor)))
    return frozenset(devices)
