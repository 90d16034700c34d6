"""The HF Trainer's arguments (``training_args.bin``) an import reads, each checked for its type and range.

The file arrives as inert records (``source.load_record``); each field read, or that says how the run was trained,
must be of its type and range, else one line names the file and the field. A string is never taken for a number:
``"${oc.env:HOME}"`` would be interpolated if it reached the recipe the import writes.
"""

from __future__ import annotations

import re
from functools import partial
from pathlib import Path
from typing import Any, Callable

from automodel_ckpt.interop.source import MAX_BATCH, MAX_STEPS, count, fraction, number, refuse
from automodel_ckpt.shown import shown_value

_NAME = re.compile(r"[A-Za-z0-9_]{1,64}")
SEED_LIMIT = 2**32 - 1  # NumPy's seeds (the Trainer seeds it too) stop there


def _warmup_steps(value: Any, where: Path, name: str) -> int | float:
    """Steps, or (a number below 1, as the Trainer reads it) a ratio of the run's steps."""
    value = number(value, where, name)
    if value < 1:
        return value
    if value > MAX_STEPS:
        raise refuse(where, f"{name} is {value:g}, not a count of steps from 0 to {MAX_STEPS}")
    return int(value)


def _steps_or_unset(value: Any, where: Path, name: str) -> int:
    """``max_steps``: a count, or -1 (the Trainer's "train by epochs")."""
    return -1 if value == -1 and not isinstance(value, bool) else count(value, where, name)


def _epochs(value: Any, where: Path, name: str) -> float:
    value = number(value, where, name)
    if value > MAX_STEPS:
        raise refuse(where, f"{name} is {value:g}, not a number of epochs from 0 to {MAX_STEPS}")
    return value


def _scheduler_name(value: Any, where: Path, name: str) -> str:
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise refuse(where, f"{name} is {shown_value(value)}, not a scheduler's name")
    return value


def _flag(value: Any, where: Path, name: str) -> bool:
    if not isinstance(value, bool):
        raise refuse(where, f"{name} is {shown_value(value)}, not true or false")
    return value


_seed = partial(count, limit=SEED_LIMIT)
_batch = partial(count, limit=MAX_BATCH, low=1)
_beta = partial(fraction, below_one=True)
#: the scheduler's arguments an import reads (``lr_scheduler_kwargs``): each a finite number >= 0, a rate at most 1
_KWARGS: dict[str, Callable[[Any, Path, str], Any]] = {"num_cycles": number, "min_lr": number, "min_lr_rate": fraction}


def _kwargs(value: Any, where: Path, name: str) -> dict[str, Any]:
    if isinstance(value, str) and value.strip() in ("", "{}"):
        return {}
    if not isinstance(value, dict):
        raise refuse(where, f"{name} is {shown_value(value)}, not a mapping of the scheduler's arguments")
    return {key: check(value[key], where, f"{name}.{key}") for key, check in _KWARGS.items()
            if value.get(key) is not None}


#: field -> its check (a value of None is "not set" for the fields that may be unset)
FIELDS: dict[str, Callable[[Any, Path, str], Any]] = {
    "learning_rate": number, "weight_decay": number, "adam_beta1": _beta, "adam_beta2": _beta,
    "adam_epsilon": number, "max_grad_norm": number, "num_train_epochs": _epochs, "max_steps": _steps_or_unset,
    "warmup_steps": _warmup_steps, "warmup_ratio": fraction, "lr_scheduler_type": _scheduler_name,
    "lr_scheduler_kwargs": _kwargs, "per_device_train_batch_size": _batch, "gradient_accumulation_steps": _batch,
    "seed": _seed, "data_seed": _seed, "dataloader_drop_last": _flag,
}
_UNSETTABLE = {"max_grad_norm", "warmup_ratio", "lr_scheduler_kwargs", "data_seed", "dataloader_drop_last",
               "gradient_accumulation_steps"}


def checked(args: dict[str, Any], where: Path) -> dict[str, Any]:
    """The fields of ``args`` (``training_args.bin``'s, as plain data) that ``FIELDS`` names, each checked (absent:
    left out; None: left out where the Trainer allows it to be unset); a one-line ``CheckpointError`` naming the
    file and the field otherwise."""
    return {name: check(args[name], where, name) for name, check in FIELDS.items()
            if name in args and not (args[name] is None and name in _UNSETTABLE)}
