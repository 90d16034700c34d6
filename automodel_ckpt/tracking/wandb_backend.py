"""Weights & Biases: one run id per training run, reused on resume; metrics by step, events as tags and summary."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from automodel_ckpt.tracking.base import Backend, OpenContext


class WandbBackend(Backend):
    """``logging.wandb``: ``wandb.init(id=..., resume="allow")``, the id in each checkpoint. W&B buffers (a SIGKILL
    loses seconds) and offline writes a folder per launch, so a resume replays the run's history: offline, the
    newest folder holds every step once; online, the server keeps a step's first value and the replay fills gaps."""

    name = "wandb"
    module = "wandb"
    extra = "wandb"
    durable = False

    def location(self, run_dir: Path, run_name: str) -> str:
        """The W&B project (``entity/project``) the run is sent to: a saved run id is reused only there."""
        return f"wandb:{self.section.get('entity') or ''}/{self.section.get('project') or run_name}"

    def initial_state(self, saved: dict[str, Any]) -> dict[str, Any]:
        return {"run_id": saved.get("run_id") or uuid.uuid4().hex[:12]}  # so no checkpoint waits for wandb.init

    def open(self, ctx: OpenContext) -> dict[str, Any]:
        import wandb

        run_id = ctx.saved["run_id"]
        directory = self.section.get("dir") or str(ctx.run_dir)
        self.run = wandb.init(
            project=self.section.get("project") or ctx.run_name, entity=self.section.get("entity"),
            mode=self.section.get("mode"), dir=directory, id=run_id, resume="allow", name=ctx.run_name,
            config=ctx.hparams, allow_val_change=True,
        )
        self.offline = bool(getattr(self.run.settings, "_offline", False))
        return {"run_id": run_id}

    def first_replay_step(self, confirmed_step: int) -> int:
        if self.offline:
            return 1  # this launch's folder gets the whole history
        return max(1, int(getattr(self.run, "step", 0) or 0))  # what the server already has is kept

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_event(self, kind: str, text: str, step: int) -> None:
        self.run.log({f"events/{kind}": step}, step=step)
        self.run.summary[f"events/{kind}"] = text
        self.run.tags = tuple(sorted(set(self.run.tags or ()) | {kind}))

    def close(self, status: str) -> None:
        if status == "preempted":
            self.run.mark_preempting()
        self.run.finish(exit_code=0 if status in ("complete", "preempted") else 1)
