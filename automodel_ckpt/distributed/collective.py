"""Steps every rank takes together: one rank's failure raises the same error on every rank, instead of a hang.

``collectively`` all-gathers who failed, ``on_main`` broadcasts rank 0's result or failure, both even on Ctrl-C
(raised again after); with ``--debug`` the other ranks' message carries the failing rank's traceback.
"""

from __future__ import annotations

import os
import traceback
from typing import Callable, TypeVar

from automodel_ckpt.errors import CheckpointError, UserError, first_line

_T = TypeVar("_T")


def collectively(fn: Callable[[], _T], what: str, rank: int) -> _T:
    """Run ``fn`` on every rank; if it fails anywhere, raise the first failure's message on every rank."""
    return _together(fn, what, rank, share=False)[0]


def gathered(fn: Callable[[], _T], what: str, rank: int) -> list[_T]:
    """``collectively``, and every rank's result in rank order on every rank: one round for both."""
    return _together(fn, what, rank, share=True)[1]


def _together(fn: Callable[[], _T], what: str, rank: int, *, share: bool) -> tuple[_T, list[_T]]:
    """Run ``fn`` on every rank, gathering failures (and with ``share`` results) in one round: ``(mine, every)``."""
    from automodel_ckpt.distributed.env import all_gather_object  # torch: imported by the ranks, not by verbs

    result: _T | None = None
    error: str | None = None
    caught: BaseException | None = None
    try:
        result = fn()
    except BaseException as exc:  # noqa: BLE001 - every failure, interrupts included, must reach every rank
        caught, error = exc, _describe(exc)
    outcomes = all_gather_object((error, result)) if share else [(e, None) for e in all_gather_object(error)]
    if isinstance(caught, (KeyboardInterrupt, SystemExit)):
        raise caught
    failed = [(r, e) for r, (e, _) in enumerate(outcomes) if e]
    if failed:
        r, e = failed[0]
        raise _failure(what, r, e, caught if r == rank else None)
    return result, [value for _, value in outcomes]  # type: ignore[return-value]


def on_main(fn: Callable[[], _T], what: str, rank: int) -> _T:
    """Run ``fn`` on rank 0 only; its result (or its failure) reaches every rank."""
    from automodel_ckpt.distributed.env import broadcast_object

    payload: tuple[bool, object] = (True, None)
    caught: BaseException | None = None
    if rank == 0:
        try:
            payload = (True, fn())
        except BaseException as exc:  # noqa: BLE001 - the other ranks wait in the broadcast below
            caught, payload = exc, (False, _describe(exc))
    ok, value = broadcast_object(payload)
    if isinstance(caught, (KeyboardInterrupt, SystemExit)):
        raise caught
    if not ok:
        raise _failure(what, 0, str(value), caught)
    return value  # type: ignore[return-value]


def main_first(make: Callable[[], _T], rank: int) -> _T:
    """``make()`` on rank 0, then on the others (reading what it left); a failure on rank 0 is raised on every
    rank (bad input as the same one-line error, anything else one line naming rank 0), not a barrier's hang."""
    from automodel_ckpt.distributed.env import broadcast_object

    if rank != 0:
        failure = broadcast_object(None)
        if failure is not None:
            user, text = failure
            error = UserError(text) if user else CheckpointError(f"rank 0 failed ({text}); see its message above")
            error.failed_rank = 0  # type: ignore[attr-defined] - the launcher names it (cli.common.report)
            if not user:  # the code rank 0 ends with (its exception's), whichever rank the launcher sees end first
                error.exit_code = 1  # type: ignore[misc]
            raise error
        return make()
    try:
        made = make()
    except BaseException as exc:  # noqa: BLE001 - the other ranks wait in the broadcast below
        broadcast_object((isinstance(exc, UserError), str(exc) if isinstance(exc, UserError) else
                          f"{type(exc).__name__}: {first_line(exc)}"))
        raise
    broadcast_object(None)
    return made


def _debugging() -> bool:
    """Whether the user asked for full tracebacks (``--debug``, inherited by workers as AUTOMODEL_CKPT_DEBUG=1)."""
    return os.environ.get("AUTOMODEL_CKPT_DEBUG") == "1"


def _describe(exc: BaseException) -> str:
    """The failure as sent to the other ranks: its first line, and with --debug its traceback after it."""
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    text = first_line(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {first_line(exc)}"
    if _debugging() and not isinstance(exc, CheckpointError):
        text += "\n" + "".join(traceback.format_exception(exc))
    return text


def _failure(what: str, rank: int, description: str, cause: BaseException | None) -> CheckpointError:
    """The error every rank raises: one line; with --debug a remote traceback follows it (a local one is chained)."""
    head, _, rest = description.partition("\n")
    message = f"{what} failed on rank {rank}: {head}"
    if rest and cause is None and _debugging():
        message += f"\n--- traceback on rank {rank} ---\n{rest.rstrip()}"
    error = CheckpointError(message)
    error.__cause__ = cause
    error.failed_rank = rank  # type: ignore[attr-defined] - the launcher names it (cli.common.report)
    return error
