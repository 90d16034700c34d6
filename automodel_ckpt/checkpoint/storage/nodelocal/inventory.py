"""What the node-local folders hold, which step a resume takes from them, and which rank sends which files.

After ``scan`` and ``gather``, ``choose`` and ``fill_plan`` are pure functions of the gathered data: every rank
computes the same answer without another round of messages.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from automodel_ckpt.ondisk import layout, manifest, paths
from automodel_ckpt.errors import CheckpointError, first_line


@dataclass(frozen=True)
class StepFiles:
    """One local step as one folder holds it."""

    name: str
    epoch: int
    step: int
    digest: str  # of the manifest's content: copies of one step agree on it
    listed: dict[str, int]  # every file the manifest lists, with its size
    present: dict[str, int]  # the listed files this folder holds that match the manifest
    problems: tuple[str, ...] = ()  # listed files this folder holds that do not match, one line each


@dataclass(frozen=True)
class Inventory:
    """What one rank found in its node's folder."""

    host: str
    folder_id: str  # the same for the ranks that share the folder
    steps: dict[str, StepFiles] = field(default_factory=dict)
    skipped: tuple[str, ...] = ()  # step folders that are not complete local steps, and why
    unfinished: tuple[str, ...] = ()  # steps this folder holds a staging folder of: being written, or abandoned


@dataclass(frozen=True)
class Chosen:
    """The local step a resume takes: every one of its files checks out on some rank."""

    name: str
    epoch: int
    step: int
    digest: str
    files: dict[str, int]


@dataclass(frozen=True)
class Transfer:
    """Files of the chosen step that ``sender`` sends to ``receiver`` (relative to the step's folder)."""

    sender: int
    receiver: int
    files: tuple[str, ...]


def manifest_digest(content: dict[str, Any]) -> str:
    """A digest of a manifest's content (not of its formatting)."""
    text = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def scan(folder: Path, *, checksums: bool = True, threads: int = 4, leave: Callable[[str], bool] | None = None
         ) -> Inventory:
    """What ``folder`` holds: each complete step's files that match its manifest (``leave``'s: sizes only)."""
    folder = Path(folder)
    st = os.stat(folder)
    steps: dict[str, StepFiles] = {}
    skipped: list[str] = []
    with os.scandir(folder) as it:
        entries = sorted(e.name for e in it)
    unfinished = tuple(n[len(layout.STAGING_PREFIX):] for n in entries
                       if layout.is_staging(n) and layout.parse_default_name(n[len(layout.STAGING_PREFIX):]))
    for name in entries:
        parsed = layout.parse_default_name(name)
        if parsed is None:
            continue
        path = folder / name
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            continue
        if not stat.S_ISDIR(mode):
            skipped.append(f"{name}: {paths.file_kind(mode)}, not a folder")
            continue
        found = _scan_step(path, name, parsed, checksums, threads, leave)
        if isinstance(found, str):
            skipped.append(f"{name}: {found}")
        else:
            steps[name] = found
    return Inventory(socket.gethostname(), folder_id(folder, st), steps, tuple(skipped), unfinished)


def folder_id(folder: Path, st: os.stat_result | None = None) -> str:
    """The same string for every rank writing to the same folder (host, device, inode)."""
    st = st or os.stat(folder)
    return f"{socket.gethostname()}:{st.st_dev}:{st.st_ino}"


def _scan_step(path: Path, name: str, parsed: tuple[int, int], checksums: bool, threads: int,
               leave: Callable[[str], bool] | None) -> StepFiles | str:
    try:
        manifest.check_layout_version(path)
        content = manifest.read_manifest(path)
    except CheckpointError as exc:
        return first_line(exc)
    if content is None:
        return f"no {layout.MANIFEST_FILE} (being written, or left by a failed save)"
    listed = {rel: int(entry["size"]) for rel, entry in content["files"].items()}
    report = manifest.verify_manifest(path, checksums=checksums and leave is None, unexpected=False, threads=threads)
    if report.problem:
        return report.problem
    verdicts = {v.path: v for v in report.verdicts}
    if checksums and leave is not None:
        hashed = [rel for rel, v in verdicts.items() if v.ok and not leave(rel)]
        verdicts.update((v.path, v) for v in manifest.verify_manifest(path, only=hashed, unexpected=False).verdicts)
    present = {rel: listed[rel] for rel, v in verdicts.items() if v.ok}
    problems = tuple(v.describe() for v in verdicts.values() if v.status != manifest.MISSING and not v.ok)
    return StepFiles(name, parsed[0], parsed[1], manifest_digest(content), listed, present, problems)


def choose(inventories: dict[int, Inventory], skipped: list[str] | None = None) -> Chosen | None:
    """The newest step with the same manifest everywhere and every file checking out on some rank, never one a
    folder still stages (its commit did not go through everywhere); passed-over steps go to ``skipped``."""
    unfinished = {n for rank in sorted(inventories) for n in inventories[rank].unfinished}
    holders: dict[str, list[StepFiles]] = {}
    for rank in sorted(inventories):
        for name, held in inventories[rank].steps.items():
            holders.setdefault(name, []).append(held)
    for name in sorted(holders, key=lambda n: (holders[n][0].step, holders[n][0].epoch), reverse=True):
        copies = holders[name]
        if name in unfinished:
            _note(skipped, f"local step {name}: not committed on every node (a staging folder of it is left)")
            continue
        if len({c.digest for c in copies}) > 1:
            _note(skipped, f"local step {name}: its manifest differs between nodes")
            continue
        found = set().union(*(c.present for c in copies))
        missing = sorted(set(copies[0].listed) - found)
        if missing:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            _note(skipped, f"local step {name}: '{missing[0]}'{more} checks out on no node")
            continue
        first = copies[0]
        return Chosen(name, first.epoch, first.step, first.digest, dict(first.listed))
    return None


def _note(skipped: list[str] | None, line: str) -> None:
    if skipped is not None:
        skipped.append(line)


def fill_plan(inventories: dict[int, Inventory], chosen: Chosen) -> list[Transfer]:
    """Which rank sends which files of ``chosen`` so every node holds them all: a sender on the same host first,
    then the least loaded; a folder's missing files spread over the ranks that share it."""
    folders: dict[str, list[int]] = {}
    for rank in sorted(inventories):
        folders.setdefault(inventories[rank].folder_id, []).append(rank)

    def holding(rank: int) -> StepFiles | None:
        held = inventories[rank].steps.get(chosen.name)
        return held if held is not None and held.digest == chosen.digest else None

    holders = [rank for rank in sorted(inventories) if holding(rank) is not None]
    needs: list[tuple[int, str, str]] = []  # (size, name, folder)
    for folder_id, ranks in folders.items():
        held = holding(ranks[0])
        have = held.present if held is not None else {}
        needs += [(size, rel, folder_id) for rel, size in chosen.files.items() if rel not in have]
        if held is None:
            needs.append((0, layout.MANIFEST_FILE, folder_id))
    sent = {rank: 0 for rank in inventories}
    got = dict(sent)
    pairs: dict[tuple[int, int], list[str]] = {}
    for size, rel, folder_id in sorted(needs, key=lambda n: (-n[0], n[1], n[2])):
        receiver = min(folders[folder_id], key=lambda r: (got[r], r))
        senders = [r for r in holders if rel == layout.MANIFEST_FILE or rel in holding(r).present]  # type: ignore[union-attr]
        if not senders:
            raise CheckpointError(f"local step {chosen.name}: no rank holds '{rel}'")  # choose() saw to it
        host = inventories[receiver].host
        sender = min(senders, key=lambda r: (inventories[r].host != host, sent[r], r))
        sent[sender] += size
        got[receiver] += size
        pairs.setdefault((sender, receiver), []).append(rel)
    return [Transfer(s, r, tuple(sorted(files))) for (s, r), files in sorted(pairs.items())]


def sends(plan: list[Transfer], rank: int) -> dict[int, list[str]]:
    """``exchange``'s ``outgoing`` for ``rank``: the files it sends, by receiver."""
    return {t.receiver: list(t.files) for t in plan if t.sender == rank}


def receives_from(plan: list[Transfer], rank: int) -> list[int]:
    """The ranks ``rank`` receives files from (``exchange``'s ``incoming`` maps each to the step's folder)."""
    return [t.sender for t in plan if t.receiver == rank]


def gather(inventory: Inventory, group: Any = None) -> dict[int, Inventory]:
    """Every rank's inventory, by global rank (collective over ``group``, default: every rank)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return {0: inventory}
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, inventory, group=group)
    return {dist.get_global_rank(group, i) if group is not None else i: inv for i, inv in enumerate(out)}
