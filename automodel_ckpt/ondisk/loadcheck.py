"""Checksums of a checkpoint's model and optimizer files computed while the load reads them (``verify_on_load``).

Each rank hashes its share as the bytes arrive; a mismatch raises ``DamagedFile`` on every rank."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from automodel_ckpt.ondisk import layout, manifest
from automodel_ckpt.ondisk.checksum import hash_file, hasher
from automodel_ckpt.errors import CheckpointError

log = logging.getLogger(__name__)


class DamagedFile(CheckpointError):
    """A model or optimizer file's checksum, computed while loading it, differs from the manifest's."""


def deferred(rel: str) -> bool:
    """Whether the load checks listed file ``rel``: a state folder's model and optimizer data files."""
    parts = Path(rel).parts
    if len(parts) != 2:
        return False
    name = parts[1]
    return layout.parse_model_shard_file(name) is not None or layout.is_dcp_data_file(name)


class LoadCheck:
    """The deferred files of this rank's share, each with its expected checksum, until it has been hashed."""

    def __init__(self, checkpoint: Path, pending: dict[str, tuple[str, str]], algorithm: str, *,
                 reads_only: bool = False) -> None:
        self.checkpoint = Path(checkpoint)
        self.pending = pending  # absolute path -> (manifest name, expected checksum)
        self.algorithm = algorithm
        self._reads_only = reads_only  # only the files a load on this rank reads are checked (``of_reads``)
        self._read: set[str] = set()  # the pending files a load on this rank read from

    @classmethod
    def plan(cls, checkpoint: Path, rank: int, world_size: int) -> LoadCheck | None:
        """This rank's deferred files of ``checkpoint``; None when it has no manifest (nothing to check)."""
        data = manifest.read_manifest(checkpoint) or {}
        listed = data.get("files")
        if not listed:
            return None
        share = manifest.assign({rel: int(e["size"]) for rel, e in listed.items()}, world_size)[rank]
        pending = {str(Path(checkpoint, rel).resolve()): (rel, str(listed[rel]["checksum"]))
                   for rel in share if deferred(rel)}
        return cls(checkpoint, pending, str(data.get("checksum_algorithm", manifest.CRC32)))

    @classmethod
    def of_reads(cls, checkpoint: Path) -> LoadCheck | None:
        """Every deferred file of ``checkpoint`` that a load on this rank reads from; None without a manifest."""
        check = cls.plan(checkpoint, 0, 1)  # one rank's share: every deferred file
        if check is not None:
            check._reads_only = True
        return check

    def hashers(self, folder: Path, reading: Iterable[str] = ()) -> dict[str, Any]:
        """``{path: hasher}`` of the pending files in ``folder``; ``reading``: what the load reads (``of_reads``)."""
        folder = Path(folder).resolve()
        read = {os.path.realpath(p) for p in reading}
        self._read |= read & set(self.pending)
        return {p: hasher(self.algorithm) for p in self.pending
                if Path(p).parent == folder and (not self._reads_only or p in read)}

    def check(self, hashed: dict[str, Any]) -> None:
        """Compare the files hashed during a load; ``DamagedFile`` on a mismatch."""
        for path, h in hashed.items():
            rel, expected = self.pending.pop(path)
            self._compare(rel, h.hexdigest(), expected)

    def _compare(self, rel: str, digest: str, expected: str) -> None:
        if digest != expected:
            raise DamagedFile(
                f"checkpoint '{self.checkpoint}' is damaged: {rel}: {manifest.CHECKSUM_MISMATCH} (manifest "
                f"{expected}, on disk {digest}) (`ckpt-train verify {self.checkpoint}` lists every file)")

    def finish(self) -> None:
        """Hash the pending files no load hashed on the way; ``DamagedFile`` on a mismatch."""
        for path, (rel, expected) in sorted(self.pending.items()):
            if not self._reads_only or path in self._read:
                self._compare(rel, hash_file(Path(path), self.algorithm)[1], expected)
        self.pending.clear()


def finish_collectively(check: LoadCheck | None, rank: int) -> None:
    """``check.finish`` on every rank; a mismatch on any rank raises ``DamagedFile`` on every rank."""
    from automodel_ckpt.distributed.env import all_gather_object

    error = None
    if check is not None:
        try:
            check.finish()
        except DamagedFile as exc:
            error = str(exc)
    errors = [e for e in all_gather_object(error) if e]
    if errors:
        raise DamagedFile(errors[0])
