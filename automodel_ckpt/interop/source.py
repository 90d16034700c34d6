"""What another trainer's checkpoint holds, in one shape (``ForeignRun``), and the bounded, allowlisted pickle reads.

Every pickle of a foreign checkpoint is read by ``load_pickle``: the file's size is checked before a byte is read,
then ``torch.load(weights_only=True)`` unpickles it, which builds tensors, numbers, strings and containers only;
``allow`` names the few other types a file needs (an RNG file's NumPy array), and ``load_record`` reads a file of
objects (the HF Trainer's ``training_args.bin``) into inert records that run no code of theirs.
"""

from __future__ import annotations

import io
import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from automodel_ckpt.errors import CheckpointError
from automodel_ckpt.ondisk import INDEX_FILE_LIMIT, check_size, open_regular, parse_json, regular_file_problem

MiB = 2**20
SMALL_PICKLE = 1 * MiB  # scheduler.pt, rng_state.pth, training_args.bin: a few KiB
STATE_JSON = INDEX_FILE_LIMIT  # trainer_state.json: its log history grows some 150 bytes a logged step
MAX_STEPS = 1 << 40  # a step, epoch or sample count past this is not a run's
RECORD_MODULES = ("transformers.", "accelerate.", "peft.")  # the objects training_args.bin may name


@dataclass
class Schedule:
    """A source's learning-rate schedule: its name there, our ``lr_scheduler`` section for it (None: none of ours)."""

    described: str
    target: str | None
    kwargs: dict[str, Any] = field(default_factory=dict)
    total_steps: int | None = None
    why_not: str = ""


@dataclass
class ForeignRun:
    """Another trainer's run at a step: everything ``interop.apply`` puts into a recipe.

    ``weights``: tensors under the source's names; ``moments``: AdamW state per optimizer slot (the source's
    parameter order), each ``{"step", "exp_avg", "exp_avg_sq"}``; ``groups``: each param group's hyperparameters
    with ``count`` (slots in it); ``order``: given our model, the name of each slot (``interop.names``).
    """

    kind: str
    weights: dict[str, torch.Tensor]
    adapter: bool
    moments: list[dict[str, torch.Tensor] | None]
    groups: list[dict[str, Any]]
    order: Callable[[Any], list[str]]
    schedule: Schedule
    step: int
    #: given the recipe's number of training rows and global batch: (epoch, steps taken in it, steps per epoch)
    #: as the source counts them (the same rows assumed)
    position: Callable[[int, int], tuple[int, int, int]]
    global_batch: int | None  # rows a step; None: not recorded (the recipe's is taken)
    world_size: int
    rng: dict[str, Any] | None
    log: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what the import cannot carry, said once
    epoch_float: float | None = None  # the source's fractional epoch, where it records one
    adapter_config: dict[str, Any] | None = None  # a PEFT run's adapter_config.json


def refuse(where: Path | str, why: str) -> CheckpointError:
    return CheckpointError(f"refusing '{where}': {why}")


def count(value: object, where: Path | str, name: str, limit: int = MAX_STEPS) -> int:
    """A non-negative integer count under ``limit`` (one-line refusal naming it otherwise)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= limit:
        raise refuse(where, f"{name} is {str(value)[:40]!r}, not a count from 0 to {limit}")
    return value


def number(value: object, where: Path | str, name: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        raise refuse(where, f"{name} is {str(value)[:40]!r}, not a finite number >= 0")
    return float(value)


def read_bytes(path: Path, what: str, limit: int) -> bytes:
    """The bytes of the regular file ``path`` (a link the user named is followed), its size checked against
    ``limit`` before a byte is read."""
    try:
        with os.fdopen(open_regular(Path(path), follow=True), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            check_size(size, f"'{path}'", what, limit)
            data = f.read(size + 1)  # a file that grows while read is still cut
    except FileNotFoundError:
        raise CheckpointError(f"'{path}' is missing ({what})") from None
    except OSError as exc:
        raise CheckpointError(f"'{path}' is unreadable ({what}): {exc.strerror or exc}") from None
    check_size(len(data), f"'{path}'", what, min(limit, size))
    return data


def _numpy_types() -> list[Any]:
    """What a pickled ``numpy.random.get_state()`` needs: one array of uint32, its dtype, nothing else."""
    import numpy as np

    core = np._core if hasattr(np, "_core") else np.core
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_pickle(path: Path, what: str, limit: int, *, numpy: bool = False) -> Any:
    """A torch-saved file of tensors, numbers and containers (with ``numpy``: a NumPy RNG state's array too), read
    with ``torch.load(weights_only=True)`` after its size is checked; one-line refusals."""
    data = read_bytes(path, what, limit)
    try:
        with torch.serialization.safe_globals(_numpy_types() if numpy else []), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's note on the pickle protocol: the refusal below says enough
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - the weights-only unpickler and garbled files raise many types
        raise refuse(path, f"{what} holds what a checkpoint of tensors and numbers does not "
                           f"({type(exc).__name__}: {_first(exc)})") from None


class Record:
    """An inert stand-in for an object of a pickle: the arguments it was made with and the state it was given."""

    def __new__(cls, *args: Any, **kwargs: Any) -> "Record":
        obj = object.__new__(cls)
        obj.args, obj.state = args, None
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def fields(self) -> dict[str, Any]:
        state = self.state[0] if isinstance(self.state, tuple) and self.state else self.state
        return dict(state) if isinstance(state, dict) else {}


def plain(value: Any) -> Any:
    """A record's value as plain data: an enum member as its value (``SchedulerType.LINEAR`` -> ``"linear"``)."""
    if isinstance(value, Record):
        return plain(value.args[0]) if len(value.args) == 1 else value.fields()
    return value


def load_record(path: Path, what: str, limit: int = SMALL_PICKLE) -> Record:
    """A pickle of library objects (``training_args.bin``) as ``Record`` stand-ins: each global it names must come
    from ``RECORD_MODULES``, and none of theirs is imported or called."""
    data = read_bytes(path, what, limit)
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data))
    except Exception as exc:  # noqa: BLE001
        raise refuse(path, f"{what} is unreadable ({type(exc).__name__}: {_first(exc)})") from None
    alien = [n for n in names if not n.startswith(RECORD_MODULES)]
    if alien:
        raise refuse(path, f"{what} names {alien[0]!r}, which no training arguments hold")
    try:
        with torch.serialization.safe_globals([(Record, n) for n in names]), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loaded = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001
        raise refuse(path, f"{what} is unreadable ({type(exc).__name__}: {_first(exc)})") from None
    if not isinstance(loaded, Record):
        raise refuse(path, f"{what} holds a {type(loaded).__name__}, not training arguments")
    return loaded


def read_state_json(path: Path, what: str) -> dict[str, Any]:
    data = parse_json(read_bytes(path, what, STATE_JSON), f"'{path}'", what, STATE_JSON)
    if not isinstance(data, dict):
        raise refuse(path, f"{what} is not a JSON object")
    return data


def regular_files(folder: Path) -> list[str]:
    """The names of the regular files directly in ``folder`` (links and others left out)."""
    return sorted(name for name in os.listdir(folder) if regular_file_problem(folder / name) is None)


def _first(exc: BaseException) -> str:
    """The line of an unpickling error that says what was refused (torch's names the global), else its first."""
    text = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    named = [line for line in text if line.startswith(("Unsupported", "Trying to", "Can only"))
             or "GLOBAL" in line]
    line = (named or text or [type(exc).__name__])[0]
    return line.split(" was not an allowed global")[0][:200]
