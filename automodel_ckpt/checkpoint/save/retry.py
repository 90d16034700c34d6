"""A node-local step that failed: what every rank agrees went wrong, and when the tier tries a step again.

A failed local step is abandoned on every rank, never the run; ``verdict`` and ``Backoff`` are pure functions of
what every rank holds, so every rank decides alike.
"""

from __future__ import annotations

import contextlib
import errno
import shutil
from dataclasses import dataclass
from pathlib import Path

from automodel_ckpt.ondisk.outofroom import out_of_room
from automodel_ckpt.errors import CheckpointError, first_line
from automodel_ckpt.sizes import human_size

_FAILED_ON = " failed on rank "
SKIP_CAP = 16  # the most due local steps skipped between two tries
_REASONS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
            errno.EROFS: "the filesystem is read-only"}


@dataclass(frozen=True)
class Outcome:
    """What one rank saw of a local step: its failure line or None, and its folder's room where it acts for it."""

    error: str | None = None
    code: int | None = None  # ENOSPC, EDQUOT or EROFS behind the failure (``ondisk.outofroom.out_of_room``), else None
    folder: str | None = None
    free: int | None = None
    need: int | None = None

    @classmethod
    def of(cls, error: BaseException | None, folder: Path | None, need: int | None) -> "Outcome":
        """This rank's outcome; ``folder`` None on a rank that does not act for its folder."""
        free = None
        with contextlib.suppress(OSError):  # removed, unreadable: no number to give
            free = shutil.disk_usage(folder).free if folder is not None else None
        if error is None:
            return cls(None, None, str(folder) if folder else None, free, need)
        text = first_line(error) if isinstance(error, CheckpointError) else \
            f"{type(error).__name__}: {first_line(error)}"
        return cls(text, out_of_room(error), str(folder) if folder else None, free, need)


def verdict(outcomes: list[Outcome]) -> str | None:
    """The cause of the step's failure on any rank, in words (out of room: the fullest folder's numbers; else the
    first failing rank's line); None when it succeeded everywhere."""
    failed = [o for o in outcomes if o.error is not None]
    if not failed:
        return None
    codes = [o.code for o in failed if o.code is not None]
    if not codes:
        return failed[0].error
    reason = _REASONS.get(codes[0], "no room")
    measured = [o for o in outcomes if o.folder is not None and o.free is not None]
    if codes[0] == errno.EROFS or not measured:  # no numbers to give: the failing line names the path
        return f"{reason} ({failed[0].error})"
    fullest = min(measured, key=lambda o: (o.free, o.folder))
    sizes = ([f"needs about {human_size(fullest.need)}"] if fullest.need else []) + \
        [f"{human_size(fullest.free)} free there"]
    doing, said, _ = failed[0].error.partition(_FAILED_ON)  # ``collective``'s "<what> failed on rank R: ..."
    return f"{reason} in '{fullest.folder}' ({', '.join(sizes)})" + (f" while {doing}" if said else "")


@dataclass
class Backoff:
    """Which due local steps are tried: all while they succeed; after a failure the next one, after each further
    failure in a row twice as many skipped as before (1, 2, 4, ... at most ``cap``); a success starts over."""

    cap: int = SKIP_CAP
    failures: int = 0  # failures in a row (reset by a success)
    _skip: int = 0  # due steps still to skip before the next try

    def attempt(self) -> bool:
        """Asked at each due local step, in order: whether to take it (False: skipped)."""
        if self._skip > 0:
            self._skip -= 1
            return False
        return True

    def failed(self) -> int:
        """A step failed; returns how many due steps are now skipped before the next try."""
        self.failures += 1
        self._skip = 0 if self.failures == 1 else min(2 ** (self.failures - 2), self.cap)
        return self._skip

    def succeeded(self) -> int:
        """A step succeeded; returns the failures in a row it ends (0 when the tier was not failing)."""
        ended, self.failures, self._skip = self.failures, 0, 0
        return ended
