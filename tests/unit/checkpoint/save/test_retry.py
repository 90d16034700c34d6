"""The node-local tier's decisions after a failed step: the backoff of its tries, and the one verdict every rank
draws from the outcomes all ranks gathered."""

from __future__ import annotations

import errno
import shutil

from automodel_ckpt.checkpoint.save.retry import Backoff, Outcome, verdict
from automodel_ckpt.errors import CheckpointError


def _tries(results: list[bool], cap: int = 16) -> list[int]:
    """The due steps (0, 1, ...) taken while each taken one fails or succeeds as ``results`` says, in order."""
    backoff, taken, due = Backoff(cap=cap), [], 0
    for ok in results:
        while not backoff.attempt():
            due += 1
        taken.append(due)
        due += 1
        backoff.succeeded() if ok else backoff.failed()
    return taken


def test_after_a_failure_the_next_due_step_is_tried_then_the_gaps_double_up_to_the_cap():
    assert _tries([False] * 7) == [0, 1, 3, 6, 11, 20, 37]  # skipped between tries: 0, 1, 2, 4, 8, 16
    assert _tries([False] * 7, cap=4) == [0, 1, 3, 6, 11, 16, 21]  # at most 4 skipped
    assert _tries([True] * 3) == [0, 1, 2]  # while they succeed, every due step


def test_a_success_ends_the_streak_and_starts_the_schedule_over():
    assert _tries([False, False, False, True, False, False]) == [0, 1, 3, 6, 7, 8]
    backoff = Backoff()
    assert [backoff.failed(), backoff.failed(), backoff.failed()] == [0, 1, 2]
    assert backoff.succeeded() == 3 and backoff.succeeded() == 0  # said once: the second success ends nothing


def test_every_rank_succeeding_is_no_failure():
    assert verdict([Outcome(folder="/a", free=10), Outcome()]) is None


def test_a_failure_seen_on_one_rank_only_is_every_ranks_failure():
    """Each rank decides on the list every rank gathered: one rank's failure makes every rank abandon the step,
    with the same cause."""
    gathered = [Outcome(folder="/shm/node0", free=1 << 30), Outcome(error="x failed on rank 1: boom")]
    assert {verdict(list(gathered)) for _rank in range(2)} == {"x failed on rank 1: boom"}


def test_the_first_failing_ranks_line_is_the_cause():
    line = "copying 'epoch_0_step_6' to other nodes failed on rank 1: node-local transfer failed: ..."
    assert verdict([Outcome(), Outcome(error=line), Outcome(error="other")]) == line


def test_out_of_room_names_the_fullest_folder_and_its_numbers():
    outcomes = [Outcome(error="writing failed on rank 1: [Errno 28] No space left on device", code=errno.ENOSPC,
                        folder="/shm/node0", free=900 << 20, need=7 << 20),
                Outcome(error="writing failed on rank 1: [Errno 28] No space left on device", code=errno.ENOSPC,
                        folder="/shm/node1", free=12 << 10, need=7 << 20)]
    expected = "no space left on device in '/shm/node1' (needs about 7.0 MiB, 12.0 KiB free there) while writing"
    assert verdict(outcomes) == expected
    assert verdict(outcomes[::-1]) == expected  # the same whichever rank reports first
    readonly = "writing failed on rank 0: [Errno 30] Read-only file system: '/shm/node0/.staging-epoch_0_step_6'"
    assert verdict([Outcome(error=readonly, code=errno.EROFS, folder="/shm/node0", free=1 << 30)]) == \
        f"the filesystem is read-only ({readonly})"


def test_each_ranks_outcome_from_its_own_failure(tmp_path):
    """The rank that hit ENOSPC sees the errno; another sees only the collective's text: both are out of room."""
    full = CheckpointError("writing failed on rank 0: [Errno 28] No space left on device")
    full.__cause__ = OSError(errno.ENOSPC, "No space left on device")
    told = CheckpointError("writing failed on rank 0: [Errno 28] No space left on device")
    mine, theirs = Outcome.of(full, tmp_path, 100), Outcome.of(told, None, None)
    assert mine.code == theirs.code == errno.ENOSPC
    assert mine.folder == str(tmp_path) and mine.free == shutil.disk_usage(tmp_path).free and mine.need == 100
    assert Outcome.of(OSError(errno.EROFS, "Read-only file system"), None, None).code == errno.EROFS
    other = Outcome.of(RuntimeError("boom"), tmp_path / "gone", None)
    assert (other.error, other.code, other.free) == ("RuntimeError: boom", None, None)
    assert Outcome.of(None, tmp_path, 5).error is None
