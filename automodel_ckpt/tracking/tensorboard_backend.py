"""TensorBoard: scalars and text events in event files; a resume purges what a crashed launch logged past it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from automodel_ckpt.ondisk import RunFolder
from automodel_ckpt.tracking.base import Backend, OpenContext


class TensorBoardBackend(Backend):
    """``logging.tensorboard``: a ``SummaryWriter`` into ``log_dir``; each launch's file has ``purge_step`` = its
    first step, so readers replace what a crashed launch logged past the checkpoint."""

    name = "tensorboard"
    module = "tensorboard"
    extra = "tensorboard"

    legacy_location_key = "log_dir"
    appends = True  # a new event file without ``purge_step``: the points join the run's, nothing is dropped

    def location(self, run_dir: Path, run_name: str) -> str:
        return os.path.abspath(self.section.get("log_dir") or RunFolder(run_dir).tensorboard)

    def same_location(self, saved: Any, location: str) -> bool:
        return isinstance(saved, str) and "\0" not in saved and os.path.abspath(saved) == location

    def open(self, ctx: OpenContext) -> dict[str, Any]:
        from torch.utils.tensorboard import SummaryWriter

        log_dir = Path(ctx.location)
        if log_dir.is_symlink():
            raise OSError(f"'{log_dir}' is a symlink: event files are not written through it")
        if ctx.append:
            if not log_dir.is_dir():
                raise OSError(f"'{log_dir}' holds no event files of the run")
            self.writer = SummaryWriter(str(log_dir))
            return {"log_dir": str(log_dir)}
        first = self.first_replay_step(ctx.confirmed_step)
        self.writer = SummaryWriter(str(log_dir), purge_step=first)
        text = yaml.safe_dump(ctx.hparams, sort_keys=False, default_flow_style=False)
        # Markdown: indented lines render as a code block
        self.writer.add_text("config", "\n".join("    " + line for line in text.splitlines()), first)
        return {"log_dir": str(log_dir)}  # a state to save: the location is saved beside it

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def log_event(self, kind: str, text: str, step: int) -> None:
        self.writer.add_text(f"events/{kind}", text, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self, status: str) -> None:
        self.writer.close()
