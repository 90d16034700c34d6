"""Atomic publication of an HF export, the coordination of the ranks writing it, and an export's lineage file.

An export is written into a hidden sibling folder, renamed into place only when every file is complete and removed
on failure; with several ranks, rank 0 renames once all report success (through the process group, else markers).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Any, Protocol

import torch

from automodel_ckpt.ondisk import (HFFolder, fsync_dir, old_sibling, open_regular, remove_tree, replace_folder,
                                   tmp_sibling, write_durable)
from automodel_ckpt.errors import CheckpointError, UserError, first_line


class ExportPlan(Protocol):
    """What publication needs from the export plan (``plan.ExportPlan``): the files it writes, and its identity."""

    def expected_names(self) -> set[str]: ...

    def fingerprint(self) -> str: ...


logger = logging.getLogger(__name__)

_RANK_WAIT_TIMEOUT_S = 6 * 3600.0  # rank 0 waits this long for other ranks' files in file-coordinated runs
_RANK_WAIT_POLL_S = 0.2


def make_coordinator(out_dir: Path, rank: int, world_size: int) -> Coordinator:
    """The coordination that fits: none (one process), the process group, or marker files."""
    if world_size == 1:
        return Coordinator(out_dir, rank, world_size)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        if torch.distributed.get_world_size() == world_size:
            return _DistCoordinator(out_dir, rank, world_size)
    return _FileCoordinator(out_dir, rank, world_size)


class Coordinator:
    """Single process: a private temporary folder, renamed into place on success, removed on failure."""

    def __init__(self, out_dir: Path, rank: int, world_size: int) -> None:
        self.out_dir, self.rank, self.world_size = out_dir, rank, world_size
        self.tmp = tmp_sibling(out_dir, secrets.token_hex(4))

    def begin(self) -> Path:
        _make_folder(self.tmp, self.out_dir)
        return self.tmp

    def end(self, error: BaseException | None, plan: ExportPlan | None) -> None:
        if error is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise _as_checkpoint_error(error)
        assert plan is not None
        self._finalize(plan)

    def _finalize(self, plan: ExportPlan) -> None:
        try:
            _swap_in(self.tmp, self.out_dir, plan.expected_names())
        except BaseException as e:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise _as_checkpoint_error(e) from None
        logger.info("exported %s", self.out_dir)


class _DistCoordinator(Coordinator):
    """torch.distributed ranks: rank 0 names and creates the folder, all ranks report, rank 0 renames."""

    def begin(self) -> Path:
        import torch.distributed as dist

        message: list[Any] = [None]
        if self.rank == 0:
            try:
                _make_folder(self.tmp, self.out_dir)
                message = [str(self.tmp)]
            except CheckpointError as e:
                message = [e]
        dist.broadcast_object_list(message, src=0)
        if isinstance(message[0], BaseException):
            raise message[0]
        self.tmp = Path(message[0])
        return self.tmp

    def end(self, error: BaseException | None, plan: ExportPlan | None) -> None:
        import torch.distributed as dist

        errors: list[Any] = [None] * self.world_size
        dist.all_gather_object(errors, None if error is None else first_line(error))
        failed = [(r, msg) for r, msg in enumerate(errors) if msg is not None]
        if failed:
            if self.rank == 0:
                shutil.rmtree(self.tmp, ignore_errors=True)
            if error is not None:
                raise _as_checkpoint_error(error)
            r, msg = failed[0]
            raise CheckpointError(f"consolidation failed on rank {r}: {msg}")
        outcome: list[Any] = [None]
        if self.rank == 0:
            try:
                assert plan is not None
                self._finalize(plan)
            except CheckpointError as e:
                outcome = [str(e)]
        dist.broadcast_object_list(outcome, src=0)
        if outcome[0] is not None:
            raise CheckpointError(outcome[0])


class _FileCoordinator(Coordinator):
    """Ranks without a process group share a temporary folder named after the world size. Each leaves a marker
    holding the plan fingerprint (a stale one from an interrupted run does not match, or describes identical files)
    or a failure note; rank 0 waits for every marker, then renames, or gives up and cleans up on a failure."""

    def __init__(self, out_dir: Path, rank: int, world_size: int) -> None:
        super().__init__(out_dir, rank, world_size)
        self.tmp = tmp_sibling(out_dir, f"ranks{world_size}")
        self.marker = HFFolder(self.tmp).rank_done(rank)
        self.failure = HFFolder(self.tmp).rank_failed(rank)

    def begin(self) -> Path:
        _make_folder(self.tmp, self.out_dir, exist_ok=True)
        for stale in (self.marker, self.failure):
            stale.unlink(missing_ok=True)
        return self.tmp

    def end(self, error: BaseException | None, plan: ExportPlan | None) -> None:
        if error is not None:
            if self.rank == 0:
                shutil.rmtree(self.tmp, ignore_errors=True)
            else:
                try:
                    write_durable(self.failure, first_line(error))
                except OSError:
                    logger.warning("could not record the failure in %s", self.failure)
            raise _as_checkpoint_error(error)
        assert plan is not None
        fingerprint = plan.fingerprint()
        write_durable(self.marker, fingerprint)
        if self.rank != 0:
            return
        self._wait_for_ranks(fingerprint)
        self._finalize(plan)

    def _wait_for_ranks(self, fingerprint: str) -> None:
        deadline = time.monotonic() + _RANK_WAIT_TIMEOUT_S
        waiting = set(range(1, self.world_size))
        while waiting:
            for r in sorted(waiting):
                failure = HFFolder(self.tmp).rank_failed(r)
                if os.path.lexists(failure):
                    msg = _read_note(failure)
                    shutil.rmtree(self.tmp, ignore_errors=True)
                    raise CheckpointError(f"consolidation failed on rank {r}: {msg}")
                marker = HFFolder(self.tmp).rank_done(r)
                if os.path.lexists(marker) and _read_note(marker) == fingerprint:
                    waiting.discard(r)
            if waiting:
                if time.monotonic() > deadline:
                    shutil.rmtree(self.tmp, ignore_errors=True)
                    raise CheckpointError(f"gave up waiting for consolidation rank(s) {sorted(waiting)} in {self.tmp}")
                time.sleep(_RANK_WAIT_POLL_S)


def _make_folder(tmp: Path, out_dir: Path, exist_ok: bool = False) -> None:
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir(exist_ok=exist_ok)
    except OSError as e:
        raise CheckpointError(f"output folder {out_dir.parent} is not writable ({e.strerror or e})") from None
    if tmp.is_symlink():  # a shared folder's name, taken by a link: never written through
        raise CheckpointError(f"'{tmp}' is a symlink, not a folder; an export is written only into a folder of its "
                              "own: remove it")


def _swap_in(tmp: Path, out_dir: Path, expected: set[str]) -> None:
    """Rename the finished ``tmp`` to ``out_dir``; an existing export is moved aside first, then deleted."""
    for entry in tmp.iterdir():  # markers, or leftovers of an interrupted run with another layout
        if entry.name not in expected:
            remove_tree(entry)
    fsync_dir(tmp)
    replace_folder(tmp, out_dir, old_sibling(out_dir, secrets.token_hex(4)).name)


def _read_note(path: Path) -> str:
    """A rank's marker or failure note: its text, or "" when it is no regular file (never followed or waited on)."""
    try:
        with os.fdopen(open_regular(path), "rb") as f:
            return f.read(4096).decode("utf-8", "replace").strip()
    except OSError:
        return ""


def _as_checkpoint_error(error: BaseException) -> BaseException:
    """User errors and interrupts pass through; I/O errors become one-line CheckpointErrors naming the file."""
    if isinstance(error, (UserError, KeyboardInterrupt, SystemExit)):
        return error
    if isinstance(error, OSError):
        where = f" at {error.filename}" if error.filename else ""
        return CheckpointError(f"consolidation failed{where}: {error.strerror or error}")
    return error


def write_lineage_file(folder: str | Path, record: dict[str, Any]) -> Path:
    """``record`` as ``folder``'s lineage file (an export folder: Hugging Face, int8, HF Trainer), written whole."""
    file = HFFolder(folder).lineage
    write_durable(file, json.dumps(record, indent=2, default=str) + "\n")
    return file
