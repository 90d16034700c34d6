"""MLflow: one run per training run, reopened on resume; metrics, parameters, events as tags."""

from __future__ import annotations

import logging
import os
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

from automodel_ckpt.ondisk import RunFolder
from automodel_ckpt.tracking.base import Backend, OpenContext, flatten

PARAMS_PER_BATCH = 100  # MLflow's limit for log_batch
PARAM_VALUE_MAX = 6000  # MLflow's limit for a parameter value
TAG_VALUE_MAX = 5000
_SQLITE = "sqlite:///"
_PRESENCE_KEYS = {"train": "train/loss", "val": "val/loss", "checkpoint": "checkpoint/blocked_s"}  # one per source
RUN_KEY_TAG = "automodel_ckpt.run_key"  # set on the tracked run when created: ``initial_state``'s key


def default_store(run_dir: Path) -> str:
    """``logging.mlflow``'s default URI: a SQLite database in the run folder (MLflow's recommended local store), or
    an earlier version's file store ``mlruns/`` there, continued (a real folder only)."""
    legacy = RunFolder(run_dir).mlflow_dir
    if legacy.is_dir() and not legacy.is_symlink():
        return legacy.resolve().as_uri()
    return _SQLITE + str(RunFolder(run_dir).mlflow_db.resolve())


class MLflowBackend(Backend):
    """``logging.mlflow``: ``MlflowClient`` on ``tracking_uri`` (default: ``default_store``). Its history is
    append-only, so steps a crashed launch logged past the checkpoint appear twice: the tag ``resumed.step_N``
    marks where the later values start, and readers keep each step's last (``last_per_step``)."""

    name = "mlflow"
    module = "mlflow"
    extra = "mlflow"
    legacy_location_key = "tracking_uri"
    acknowledged = True  # each call returns once the store (a server or the SQLite file) has it
    appends = True  # metric histories are append-only: a point at an earlier step joins the series

    def local_path(self, location: str) -> Path | None:
        if location.startswith(_SQLITE):
            return Path(location[len(_SQLITE):])
        if location.startswith("file:"):
            from urllib.parse import unquote, urlparse

            return Path(unquote(urlparse(location).path))
        return Path(location) if "://" not in location else None

    def location(self, run_dir: Path, run_name: str) -> str:
        return str(self.section.get("tracking_uri") or default_store(run_dir))

    def open(self, ctx: OpenContext) -> dict[str, Any]:
        if ctx.append:
            return self._open_to_append(ctx)
        uri = ctx.location
        artifacts = None
        if uri.startswith(_SQLITE) and not self.section.get("tracking_uri"):
            database = Path(uri[len(_SQLITE):])
            if database.is_symlink() or (database.exists() and not database.is_file()):
                raise OSError(f"'{database}' is not a regular file: the store is not written through it")
            artifacts = RunFolder(database.parent).mlflow_artifacts.as_uri()
            for quiet in ("alembic", "mlflow.store.db.utils"):  # "Creating initial MLflow database tables..."
                logging.getLogger(quiet).setLevel(logging.WARNING)
            if not database.exists():
                _create_store(database, artifacts)
        if uri.startswith("file:") or "://" not in uri:
            # MLflow keeps its file store in maintenance mode and asks for this opt-in; the store works as before
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            if not self.section.get("tracking_uri"):
                store = RunFolder(ctx.run_dir).mlflow_dir
                warnings.warn(f"logging.mlflow: continuing the file store '{store}' of an earlier version; MLflow's "
                              f"own tools open it only with MLFLOW_ALLOW_FILE_STORE=true. To move it: mlflow "
                              f"migrate-filestore --source {store} --target {_SQLITE}{store.parent.resolve()}/"
                              f"{RunFolder.mlflow_db}, then remove '{store}' (the next launch starts a new tracked "
                              "run in the database)", stacklevel=2)
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        key = ctx.saved.get("run_key")
        name = self.section.get("experiment") or ctx.run_name
        run_id = self._reopen(ctx.saved.get("run_id") or self._find(name, key))
        reopened = run_id is not None
        if run_id is None:
            experiment = self.client.get_experiment_by_name(name)
            experiment_id = experiment.experiment_id if experiment is not None else \
                self.client.create_experiment(name, artifact_location=artifacts)
            tags = {RUN_KEY_TAG: key} if key else None
            run_id = self.client.create_run(experiment_id, run_name=ctx.run_name, tags=tags).info.run_id
            self._log_params(run_id, ctx.hparams)
        self.run_id = run_id
        self._present = self._steps_present(run_id, ctx.resume_step) if reopened and ctx.resume_step else {}
        if ctx.resume_step is not None:
            self.client.set_tag(run_id, f"resumed.step_{ctx.resume_step}",
                                f"values of steps after {ctx.resume_step} logged before this resume are superseded "
                                "by the ones logged after it (keep the last value per step)")
        return {"run_id": run_id, "run_key": key} if key else {"run_id": run_id}

    def _open_to_append(self, ctx: OpenContext) -> dict[str, Any]:
        """The tracked run the checkpoint names, as it is: never created, its status and parameters untouched."""
        uri = ctx.location
        if uri.startswith(_SQLITE):
            database = Path(uri[len(_SQLITE):])
            if not database.is_file() or database.is_symlink():
                raise OSError(f"'{database}' is not the run's MLflow store (no such regular file)")
        elif uri.startswith("file:") or "://" not in uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self.client, self._append = MlflowClient(tracking_uri=uri), True
        run_id = ctx.saved.get("run_id") or self._find(self.section.get("experiment") or ctx.run_name,
                                                        ctx.saved.get("run_key"))
        if run_id is None:
            raise OSError(f"the store {uri} has no tracked run of this run")
        self.run_id = self.client.get_run(run_id).info.run_id  # an MlflowException when the store lost it
        return {"run_id": run_id}

    def initial_state(self, saved: dict[str, Any]) -> dict[str, Any]:
        """A key tagged on the run at creation: a checkpoint saved before the run existed still finds it."""
        return {"run_key": saved.get("run_key") or uuid.uuid4().hex}

    def _find(self, experiment: str, key: str | None) -> str | None:
        """The run created with ``key`` in ``experiment``, if any."""
        found = self.client.get_experiment_by_name(experiment) if key else None
        if found is None:
            return None
        runs = self.client.search_runs([found.experiment_id], f"tags.{RUN_KEY_TAG} = '{key}'", max_results=1)
        return runs[0].info.run_id if runs else None

    def _steps_present(self, run_id: str, last: int) -> dict[str, set[int]]:
        """The steps up to ``last`` the reopened run has, per source, so a replay sends only what it lacks."""
        return {source: {m.step for m in self.client.get_metric_history(run_id, key) if m.step <= last}
                for source, key in _PRESENCE_KEYS.items()}

    def _reopen(self, run_id: str | None) -> str | None:
        """``run_id`` marked running again, if the store still has it; else None (a new run is created)."""
        if run_id is None:
            return None
        from mlflow.exceptions import MlflowException

        try:
            self.client.update_run(run_id, status="RUNNING")
        except MlflowException:
            warnings.warn(f"logging.mlflow: the store has no run {run_id} any more; starting a new tracked run "
                          "(the run's history is replayed into it)", stacklevel=2)
            return None
        return run_id

    def _log_params(self, run_id: str, hparams: dict[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(k, str(v)[:PARAM_VALUE_MAX]) for k, v in flatten(hparams).items()]
        for i in range(0, len(params), PARAMS_PER_BATCH):
            self.client.log_batch(run_id, params=params[i:i + PARAMS_PER_BATCH])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        if getattr(self, "_present", None):  # a replay: what the run already has is not sent twice
            metrics = {k: v for k, v in metrics.items() if step not in self._present.get(k.partition("/")[0], ())}
            if not metrics:
                return

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])

    def log_event(self, kind: str, text: str, step: int) -> None:
        self.client.set_tag(self.run_id, f"event.{kind}.step_{step}", text[:TAG_VALUE_MAX])

    def close(self, status: str) -> None:
        if getattr(self, "_append", False):
            return  # the run's status is its training's
        self.client.set_terminated(self.run_id, {"complete": "FINISHED", "preempted": "KILLED"}.get(status, "FAILED"))


def _create_store(database: Path, artifacts: str) -> None:
    """A new SQLite store, created under another name and renamed: a launch killed meanwhile leaves no half-made one."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    new = database.with_name(RunFolder.mlflow_db_new)
    new.unlink(missing_ok=True)
    SqlAlchemyStore(_SQLITE + str(new), artifacts).engine.dispose()
    os.replace(new, database)


def last_per_step(history: list[Any]) -> list[Any]:
    """An MLflow history with each step's last value (highest timestamp, later on a tie), sorted by step."""
    latest: dict[int, tuple[int, int, Any]] = {}
    for order, metric in enumerate(history):
        key = (metric.timestamp, order)
        if metric.step not in latest or key >= latest[metric.step][:2]:
            latest[metric.step] = (*key, metric)
    return [latest[step][2] for step in sorted(latest)]
