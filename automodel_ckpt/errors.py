"""Exception types the CLI turns into one-line messages and exit codes, and the one helper for user warnings."""

from __future__ import annotations

import warnings


class UserError(Exception):
    """A problem the user can fix: the CLI prints ``error: <message>`` and exits with ``exit_code``."""

    exit_code = 2


class ConfigError(UserError):
    """The recipe or a command-line override is invalid."""


class CheckpointError(UserError):
    """A checkpoint is missing, incomplete, corrupt or does not fit the model."""

    exit_code = 3


class DiskFullError(CheckpointError):
    """A save or export ran out of room: no space left, a quota, or a read-only filesystem."""

    exit_code = 4
    errno: int | None = None


class TrainingError(UserError):
    """Training cannot go on (a non-finite loss or gradient norm): the run stops before that step is saved. With
    ``save_last_step`` (raised as the next step begins, nothing of it changed) the last complete step is saved first."""

    save_last_step = False


class UsageError(UserError):
    """A command line the verb cannot parse (unknown flag, missing argument)."""


def expect(ok: bool, key: str, expected: str, value: object) -> None:
    """``ConfigError`` "KEY: expected EXPECTED, got VALUE" unless ``ok``."""
    if not ok:
        raise ConfigError(f"{key}: expected {expected}, got {value!r}")


def first_line(exc: BaseException) -> str:
    """The first non-empty line of an exception's message, or its type name when it has none."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def warn(message: str) -> None:
    """A warning for the user, attributed to the code that calls this helper."""
    warnings.warn(message, stacklevel=2)


#: the exit codes of a process that ended on one of our one-line errors, which say everything
USER_ERROR_EXIT_CODES = frozenset({UserError.exit_code, ConfigError.exit_code, CheckpointError.exit_code,
                                   DiskFullError.exit_code, UsageError.exit_code})
