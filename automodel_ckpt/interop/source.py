"""What another trainer's checkpoint holds, in one shape (``ForeignRun``), and the bounded, allowlisted reads.

Every file is read by ``read_bytes`` (a regular file, no link followed, its size checked first against its kind's
limit or ``Limits``); a pickle is unpickled with ``weights_only=True`` (``load_pickle``), library objects in it as
inert ``Record``s that run no code of theirs (``load_inert``, ``load_record``).
"""

from __future__ import annotations

import io
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from automodel_ckpt.errors import CheckpointError
from automodel_ckpt.ondisk import INDEX_FILE_LIMIT, check_count, parse_json
from automodel_ckpt.ondisk import read_bytes as read_bounded
from automodel_ckpt.shown import shown_value

MiB = 2**20
SMALL_PICKLE = 1 * MiB  # scheduler.pt, rng_state.pth, training_args.bin: a few KiB
STATE_JSON = INDEX_FILE_LIMIT  # trainer_state.json: its log history grows some 150 bytes a logged step
MAX_STEPS = 1 << 40  # a step, epoch or sample count past this is not a run's
#: steps of a schedule the import writes (``step_scheduler.max_steps``) and checks the recipe against step by step
#: (some 2 s a million steps): the longest fine-tuning runs take a few hundred thousand
MAX_SCHEDULE_STEPS = 10**7
_LARGEST = sys.float_info.max
MAX_BATCH = 1 << 24  # rows a device takes a step, or micro-batches accumulated: past this, no run's
RECORD_MODULES = ("transformers.", "accelerate.", "peft.")  # the objects training_args.bin may name
SLACK = 16 * MiB  # headers, counters, schedulers and small buffers beside a checkpoint's tensors


@dataclass(frozen=True)
class Limits:
    """The most bytes a source's tensors may take, from ``params``, the size (parameters and buffers) of the model
    the recipe builds: its weights 8 bytes each (fp64 at most), AdamW's state 32 (8 times the fp32 weights: two
    moments and a step, generously), each with ``SLACK`` beside."""

    params: int

    @property
    def weights(self) -> int:
        return 8 * self.params + SLACK

    @property
    def optimizer(self) -> int:
        return 32 * self.params + SLACK

    @property
    def checkpoint(self) -> int:
        """A Lightning checkpoint: the weights and the optimizer's state in one file or folder."""
        return self.weights + self.optimizer


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
    with ``count`` (slots in it); ``order``: given our model, the name of each slot (``interop.names``)."""

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
    #: the weights as the source's model held them (its training dtype) where they differ from ``weights`` (a
    #: DeepSpeed run's module beside its fp32 master weights): what ``import --check`` compares against
    module_weights: dict[str, torch.Tensor] | None = None
    #: where the source's tensors take our layout only given the recipe's model (torchtitan's q and k rows, permuted
    #: for RoPE by its head counts): ``apply`` calls it with the model first; it fills ``weights`` and ``moments``
    fit: Callable[[Any], None] | None = None


def rows_in_order(step: int, rows: int, batch: int) -> tuple[int, int, int]:
    """``ForeignRun.position`` at ``step`` of a run that reads ``rows`` rows in order, ``batch`` a step (a plain
    ``DataLoader``: the last batch of an epoch partial)."""
    per_epoch = max(1, -(-rows // max(batch, 1)))
    return step // per_epoch, step % per_epoch, per_epoch


def refuse(where: Path | str, why: str) -> CheckpointError:
    return CheckpointError(f"refusing '{where}': {why}")


def count(value: object, where: Path | str, name: str, limit: int = MAX_STEPS, low: int = 0) -> int:
    """An integer from ``low`` to ``limit`` (a whole float counts); ``bounded.check_count``'s refusal otherwise."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return check_count(value, f"refusing '{where}'", name, limit, low)


def number(value: object, where: Path | str, name: str) -> float:
    value = finite(value, where, name)
    if value < 0:
        raise refuse(where, f"{name} is {value!r}, not a finite number >= 0")
    return value


def finite(value: object, where: Path | str, name: str) -> float:
    """``value`` as a float if it is a finite int or float (one-line refusal naming it otherwise)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not -_LARGEST <= value <= _LARGEST:  # NaN, infinities, huge ints
        raise refuse(where, f"{name} is {shown_value(value)}, not a finite number")
    return float(value)


def fraction(value: object, where: Path | str, name: str, *, below_one: bool = False) -> float:
    """A finite number from 0 to 1 (below 1 with ``below_one``: Adam's betas), else a one-line refusal naming it."""
    value = finite(value, where, name)
    if not 0 <= value <= 1 or (below_one and value == 1):
        raise refuse(where, f"{name} is {value!r}, not a number from 0 to 1{' (below 1)' if below_one else ''}")
    return value


def read_bytes(path: Path, what: str, limit: int, *, follow: bool = False) -> bytes:
    """``ondisk.read_bytes`` (a regular file, followed only with ``follow``, size checked first); one-line refusals."""
    try:
        return read_bounded(Path(path), what, limit, follow=follow)
    except FileNotFoundError:
        raise CheckpointError(f"'{path}' is missing ({what})") from None
    except OSError as exc:
        raise CheckpointError(f"'{path}' is unreadable ({what}): {exc.strerror or exc}") from None


def _numpy_types() -> list[Any]:
    """What a pickled ``numpy.random.get_state()`` needs: one array of uint32, its dtype, nothing else."""
    import numpy as np

    core = np._core if hasattr(np, "_core") else np.core
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_pickle(path: Path, what: str, limit: int, *, numpy: bool = False, follow: bool = False) -> Any:
    """``read_bytes``, then ``torch.load(weights_only=True)`` (``numpy``: a NumPy RNG state's array too); one-line
    refusals."""
    data = read_bytes(path, what, limit, follow=follow)
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
    loaded = load_inert(path, what, limit, RECORD_MODULES, "which no training arguments hold")
    if not isinstance(loaded, Record):
        raise refuse(path, f"{what} holds a {type(loaded).__name__}, not training arguments")
    return loaded


def load_inert(path: Path, what: str, limit: int, modules: tuple[str, ...], alien_why: str) -> Any:
    """A pickle of tensors, containers and objects of ``modules`` (each a ``Record`` stand-in, never imported or
    called); a global from elsewhere is refused (``alien_why``)."""
    data = read_bytes(path, what, limit)
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data))
    except Exception as exc:  # noqa: BLE001
        raise refuse(path, f"{what} is unreadable ({type(exc).__name__}: {_first(exc)})") from None
    alien = sorted(n for n in names if not n.startswith(modules))
    if alien:
        raise refuse(path, f"{what} names {alien[0]!r}, {alien_why}")
    try:
        with torch.serialization.safe_globals([(Record, n) for n in names]), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001
        raise refuse(path, f"{what} is unreadable ({type(exc).__name__}: {_first(exc)})") from None


def read_json(path: Path, what: str, limit: int = STATE_JSON) -> dict[str, Any]:
    """A JSON object of a file (``read_bytes``; its nesting bounded); one-line refusals."""
    data = parse_json(read_bytes(path, what, limit), f"'{path}'", what, limit)
    if not isinstance(data, dict):
        raise refuse(path, f"{what} is not a JSON object")
    return data


def _first(exc: BaseException) -> str:
    """The line of an unpickling error that says what was refused (torch's names the global), else its first."""
    text = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    named = [line for line in text if line.startswith(("Unsupported", "Trying to", "Can only")) or "GLOBAL" in line]
    line = (named or text or [type(exc).__name__])[0]
    return line.split(" was not an allowed global")[0][:200]
