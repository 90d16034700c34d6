"""The one contract every training data loader keeps (map-style or streamed): a recipe never asks which it has."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from automodel_ckpt.data.loader import MicroBatch


@runtime_checkable
class BatchLoader(Protocol):
    """Per optimizer step, this rank's micro-batches of one global batch, from a position that checkpoints."""

    global_batch_size: int  # samples (or sequences) per optimizer step, over every data-parallel rank
    grad_accum: int  # micro-batches per step on a rank
    steps_per_epoch: int  # optimizer steps an epoch makes (a stream: unbounded)
    last_sample_ids: list[int]  # the ids of the step just served (``training.log_sample_ids``)

    @property
    def epoch(self) -> int:
        """The epoch of the data served last."""

    def next_batch(self) -> tuple[int, list[MicroBatch]]:
        """The next step's micro-batches, and the epoch they belong to."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def report(self, waited: float) -> dict[str, Any]:
        """What the step just served adds to its record (``waited``: seconds spent waiting for the batch)."""

    def summary(self) -> dict[str, Any] | None:
        """Where the loader is, for a checkpoint's metadata and ``inspect`` (``data_position``), or None."""

    def steps_left(self, num_epochs: int) -> int:
        """Optimizer steps left until ``num_epochs`` epochs are served from the position (a stream: unbounded)."""

    def begin_stage(self) -> str | None:
        """A new stage starts from the restored position: what changes, in one line, or None."""
