"""One save at a time on every rank: the state's files written now or in the background, then the checkpoint completed.

The steps (reserve, write or stage, small files, then export, fsync, manifest, upload, commit, retention) are
docs/architecture.md's. Every step that can fail on one rank is collective, so every rank raises the same error.
"""

from __future__ import annotations

import functools
import io
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch

from automodel_ckpt.distributed import collective
from automodel_ckpt.ondisk import layout, manifest
from automodel_ckpt.ondisk.durable import WrittenFiles, fsync_tree
from automodel_ckpt.ondisk.incremental import Reuse
from automodel_ckpt.ondisk.layout import render_name
from automodel_ckpt.ondisk.formats import registry, sharded
from automodel_ckpt.ondisk.formats.base import ModelFormat, ModelWriter
from automodel_ckpt.ondisk.info import HFArtifacts, SaveInfo
from automodel_ckpt.ondisk.metadata import build_metadata, write_metadata
from automodel_ckpt.checkpoint.save import diskfull, overlap, policy
from automodel_ckpt.checkpoint.save.phases import PhaseClock, TrainingTime
from automodel_ckpt.checkpoint.save.settings import WriteSettings
from automodel_ckpt.checkpoint.save.taken import Taken
from automodel_ckpt.checkpoint.state import StatePlan
from automodel_ckpt.checkpoint.storage.base import RunStorage
from automodel_ckpt.distributed.env import DistEnv, barrier, collectives_on
from automodel_ckpt.distributed.lifeline import stop_if_orphaned
from automodel_ckpt.distributed.mesh import ParallelDims
from automodel_ckpt.errors import CheckpointError, first_line

_T = TypeVar("_T")


class SaveWriter:
    """Writes checkpoints into ``run``; at most one save in flight (``wait`` completes it)."""

    def __init__(self, settings: WriteSettings, env: DistEnv, dims: ParallelDims, run: RunStorage, *,
                 config_yaml: str, hf: HFArtifacts, fingerprint: dict[str, Any] | None, time: TrainingTime,
                 say: Callable[[str], None], settle_full_disk: bool = True,
                 side_failure: Callable[[str, str, int], None] | None = None) -> None:
        self.settings, self.env, self.dims, self.run = settings, env, dims, run
        # read by ``diskfull.guarded``: False where the caller settles a full disk itself (the node-local tier)
        self.settles_full_disk = settle_full_disk
        self.side_failure = side_failure  # (kind, text, step): side work that failed while the save went on
        self.dir = run.local  # read by ``diskfull.guarded``
        self.config_yaml, self.hf, self.fingerprint, self.time, self.say = config_yaml, hf, fingerprint, time, say
        self.lineage: dict[str, Any] | None = None  # each checkpoint's parents (lineage.py), set by the run
        self.policy = policy.SavePolicy(settings, is_main=env.is_main)
        self.retention = settings.retention
        self.resumed_from: str | None = None  # the checkpoint this run resumed from (retention on a store keeps it)
        self.is_async = settings.is_async and overlap.async_supported(env.is_main)
        self.write_threads = settings.write_threads or overlap.default_write_threads()
        self.written = WrittenFiles()  # files this writer wrote: fsynced already, checksum known
        self.last_save_seconds: dict[str, float] = {}  # where the last save call spent its time, by phase
        self.last_complete_seconds: dict[str, float] = {}  # the same for the steps after the shards were written
        self._pending: overlap.PendingSave | None = None  # the async save still being written (at most one)
        self._saved_objects: list[Any] = []  # the state of the last save (its size is reported on a full disk)
        self._stager: sharded.HostStager | None = None
        self._thread = overlap.BackgroundThread(settings.nice)  # runs every async save's background work
        # ``checkpoint.incremental``: stable tensors apart, hard-linked from the last checkpoint when unchanged
        self.reuse = Reuse() if settings.incremental else None
        self.format = registry.get(settings.model_save_format)  # a model's own format may claim it (a PEFT adapter)
        self._model_writers: dict[str, ModelWriter] = {}  # each format's, made on first use
        self._fences: dict[int, Any] = {}  # id(optimizer) -> its step pre-hook handle (see ``fence``)
        self._group = None  # checkpointing's own process group: background writes never meet training collectives
        if self.is_async:  # collective: every rank creates it, in the same order
            import torch.distributed as dist

            self._group = overlap.threads_lowered(lambda: dist.new_group(backend="gloo"), settings.nice)

    # ------------------------------------------------------------------------------------------ a save
    @diskfull.guarded
    def write_checkpoint(self, plan: StatePlan, info: SaveInfo) -> Path:
        """Save the state of ``plan`` (``plan_state``) as checkpoint ``name``; see ``Checkpointer.save``."""
        self._saved_objects = plan.objects()
        clock = PhaseClock()
        self.wait()  # at most one save in flight: finish (and publish) the previous one first
        clock.mark("complete_previous")
        if self.reuse is not None:
            self.reuse.begin()
            if self.resumed_from is not None:  # until its first save is published: the checkpoint resumed from
                self.reuse.adopt(self.dir / self.resumed_from)
        name = render_name(  # every name is checked, before anything is created: ConfigError on every rank
            self.settings.name_template, info.epoch, info.step, consumed_samples=info.extra.get("consumed_samples"),
            train_loss=info.train_loss, val_loss=info.val_loss,
        )
        if self.env.is_main:
            self.say(f"Saving checkpoint to {self.run.location(name)}")
        formats = {attr: registry.for_model(model, self.format.name) for attr, model in plan.models.items()}
        claimed = [fmt for fmt in formats.values() if fmt is not self.format]  # a PEFT model's adapter folder
        exports = bool(plan.models) and not claimed  # an adapter folder is Hugging Face-ready already
        pending = overlap.PendingSave(name, self.run.staging(name), exports and self.policy.consolidate_now(info),
                                      step=info.step)
        reserve_in_background = self._reserves_in_background(plan, pending.consolidate, bool(claimed))
        if not reserve_in_background:
            self.run.reserve(name)
        clock.mark("reserve")
        staged = self._write_or_stage(plan, formats, pending.staging)
        clock.mark("copy_small" if self.is_async else "write_sharded")
        completes_in_background = bool(staged) and not pending.consolidate  # the inline export runs here
        small_files = self._small_files(pending.staging, plan, info, claimed[0] if claimed else self.format,
                                        serialize_later=completes_in_background)
        if completes_in_background:
            pending.small_files = small_files
        else:
            collective.collectively(small_files.write, f"writing '{pending.staging}'", self.env.rank)
        clock.mark("write_local")
        if staged:  # captured, written one at a time (then completed), on the checkpoint group by one thread
            pending.job = overlap.start(
                staged, self._group, nice=self.settings.nice,
                before_writes=(functools.partial(self._on_group, self.run.reserve, name)
                               if reserve_in_background else None),
                after_writes=(functools.partial(self._on_group, self._complete, pending)
                              if completes_in_background else None),
                thread=self._thread)
            pending.writes = [(future, item.path) for future, item in zip(pending.job.writes, staged)]
            clock.mark("start_background")
            self._pending = pending
            self.last_save_seconds = clock.phases
            return self.dir / name
        path = self._complete(pending)
        clock.mark("complete")
        self.last_save_seconds = clock.phases
        return path

    def _reserves_in_background(self, plan: StatePlan, consolidate: bool, claimed: bool) -> bool:
        """Whether the background thread reserves the staging folder (an async save writing nothing into it now)."""
        return (self.is_async and not consolidate and not claimed and self.run.reserves_in_background
                and bool(plan.models or plan.optimizers))

    def _write_or_stage(self, plan: StatePlan, formats: dict[str, ModelFormat],
                        staging: Path) -> list[sharded.StagedSave]:
        """The model and optimizer files, written now (collective), or with ``is_async`` copied now and returned to
        be written in the background (a format that stages nothing, as a PEFT adapter's, writes now)."""
        stager, staged = self._host_stager() if self.is_async else None, []
        for attr, model in plan.models.items():
            fmt = formats[attr]
            if fmt is not self.format and not self.format.holds_adapters:
                self.policy.warn_once(f"{fmt.name}_format", fmt.substitute_warning(self.format))
            staged.append(self._model_writer(fmt).write_model(model, staging / layout.state_dir(attr), stager,
                                                              self.written, self.write_threads))
        for attr, optim in plan.optimizers.items():
            folder = staging / layout.state_dir(attr)
            if stager is None:
                sharded.save_optimizer(plan.model_for(attr), optim, folder, written=self.written)
                continue
            # each node loading its own copy checks whole every file it reads: the small items go to a file apart
            staged.append(sharded.stage_optimizer(plan.model_for(attr), optim, folder, stager, self.written,
                                                  threads=self.write_threads, small_apart=not self.run.shared))
            self._install_fence(optim)
        return [item for item in staged if item is not None]

    def _model_writer(self, fmt: ModelFormat) -> ModelWriter:
        if fmt.name not in self._model_writers:
            self._model_writers[fmt.name] = fmt.writer(rank=self.env.rank, reuse=self.reuse, hf=self.hf)
        return self._model_writers[fmt.name]

    def _small_files(self, staging: Path, plan: StatePlan, info: SaveInfo, fmt: ModelFormat, *,
                     serialize_later: bool = False) -> LocalFiles:
        """This rank's small files (``capture``); ``fmt``: the model folder's format, recorded in the metadata."""
        helpers = (functools.partial(policy.write_model_helpers, staging / layout.MODEL_DIR, self.hf, fmt)
                   if plan.models and fmt is self.format else None)
        return capture(
            staging, plan, info, rank=self.env.rank, world_size=self.env.world_size,
            dp_rank=self.dims.dp_rank if self.dims.writes_rank_state else None, mesh=self.dims.sizes.record(),
            config_yaml=self.config_yaml,
            model_save_format=fmt.name,
            training_seconds=self.time.seconds(), fingerprint=self.fingerprint, write_after=helpers,
            lineage=self.lineage, serialize_later=serialize_later,
        )

    def _complete(self, pending: overlap.PendingSave) -> Path:
        """The steps after the model and optimizer files are written."""
        rank, world, staging, name = self.env.rank, self.env.world_size, pending.staging, pending.name
        if pending.writes:
            collective.collectively(functools.partial(_wait_writes, pending.writes),
                                    f"writing '{staging}' in the background", rank)
        if pending.small_files is not None:
            collective.collectively(pending.small_files.write, f"writing '{staging}'", rank)
        clock = PhaseClock()
        if pending.consolidate:
            self._export_inline(pending)
            clock.mark("consolidate")
        if self.run.durable:
            collective.collectively(functools.partial(fsync_tree, staging, rank, world, self.written),
                                    f"syncing '{staging}'", rank)
            clock.mark("sync")
        manifest.seal(staging, rank, world, self.written, shared=self.run.shared)  # manifest.json, written last
        clock.mark("manifest")
        stop_if_orphaned(f"publishing '{name}'")  # a worker that outlived its launcher never publishes
        if self.run.upload(staging, name):  # an object store: every rank's share, before the commit
            clock.mark("upload")
        best = collective.on_main(functools.partial(self.policy.is_new_best, self.run, staging),
                                  "comparing with the best checkpoint", rank)
        path = self.run.commit(staging, name, best=best)
        if self.reuse is not None:  # the next save links to this one's unchanged files
            self.reuse.published(staging, self.dir / name)
        if self.retention.prunes:
            self._prune()
        barrier()
        clock.mark("publish")
        self.last_complete_seconds = clock.phases
        return path

    def _export_inline(self, pending: overlap.PendingSave) -> None:
        """The inline Hugging Face export, side work: a failure on any rank removes what it left, rank 0 warns and
        reports it, and the checkpoint is completed without it (its consolidate.sh exports it later)."""
        rank, model_dir = self.env.rank, pending.staging / layout.MODEL_DIR
        try:
            collective.collectively(functools.partial(policy.export_inline, model_dir, rank, self.env.world_size),
                                    "consolidating the checkpoint", rank)
            return
        except CheckpointError as exc:
            failure = exc
        collective.on_main(functools.partial(policy.remove_export, model_dir), f"cleaning '{model_dir}'", rank)
        if self.env.is_main:
            text = (f"checkpoint {pending.name} is saved without its Hugging Face export ({first_line(failure)}); "
                    f"export it later with its {layout.CONSOLIDATE_SCRIPT}")
            warnings.warn(text, stacklevel=2)
            if self.side_failure is not None:
                self.side_failure("export", text, pending.step)

    def _prune(self) -> None:
        """Retention on rank 0; a failure is a warning, the checkpoint just saved stands."""
        try:
            deleted = self.run.prune(self.retention, self.resumed_from)
        except CheckpointError as exc:
            if self.env.is_main:
                warnings.warn(f"checkpoint retention: {exc}", stacklevel=3)
            return
        if deleted and self.env.is_main:
            self.say(f"Removed checkpoints by retention: {', '.join(deleted)}")

    # ------------------------------------------------------------------------------------------ in flight
    def fence(self) -> None:
        pending = self._pending
        if pending is not None and pending.job is not None:
            pending.job.fence()

    def _install_fence(self, optimizer: Any) -> None:
        if id(optimizer) not in self._fences and hasattr(optimizer, "register_step_pre_hook"):
            self._fences[id(optimizer)] = optimizer.register_step_pre_hook(lambda *_: self.fence())

    @diskfull.guarded
    def wait(self) -> Path | None:
        pending, self._pending = self._pending, None
        if pending is not None and pending.job is not None and pending.job.completed is not None:
            return pending.job.completed.result()  # published in the background (or failed there, on every rank)
        return self._complete(pending) if pending is not None else None

    def abandon(self, seconds: float) -> None:
        """Let this rank's background writes end (up to ``seconds``), without collectives and without publishing."""
        pending, self._pending = self._pending, None
        if pending is None or pending.wait_for_writes(seconds):
            self.close()

    @property
    def background(self) -> overlap.Overlapped | None:
        pending = self._pending
        return pending.job if pending is not None else None

    @property
    def in_flight(self) -> bool:
        return self._pending is not None

    def _on_group(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)`` with its collectives on checkpointing's own group: never meeting training's."""
        with collectives_on(self._group):
            return fn(*args)

    def _host_stager(self) -> sharded.HostStager:
        if self._stager is None:
            self._stager = sharded.HostStager()
        return self._stager

    def close(self) -> None:
        """Release the host buffers, the background thread (once done) and the optimizers' fences."""
        self._thread.close()
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        for handle in self._fences.values():
            handle.remove()
        self._fences.clear()
        self.written = WrittenFiles()


def _wait_writes(writes: list[tuple[Any, Path]]) -> None:
    """Every background write ends before any failure is raised: none outlives the save."""
    errors = []
    for future, folder in writes:
        try:
            sharded.wait_async_save(future, folder)
        except Exception as exc:  # noqa: BLE001 - raised below, after the other writes ended
            errors.append(exc)
    if errors:
        raise errors[0]


@dataclass
class LocalFiles:
    """A rank's small files, taken at the save (an async checkpoint is its step's state while training goes on)."""

    staging: Path
    files: dict[Path, bytes | Taken] = field(default_factory=dict)  # a ``Taken`` state is serialized when written
    metadata: dict[str, Any] | None = None  # rank 0: metadata.json, written after the other files
    write_after: Callable[[], None] | None = None  # rank 0: the Hugging Face helper files of the model folder

    def write(self) -> None:
        write_files(self.files)
        if self.metadata is not None:
            write_metadata(self.staging, self.metadata)
        if self.write_after is not None:
            self.write_after()


def capture(staging: Path, plan: StatePlan, info: SaveInfo, *, rank: int, world_size: int, config_yaml: str,
         model_save_format: str, training_seconds: float, fingerprint: dict[str, Any] | None,
         write_after: Callable[[], None] | None = None, dp_rank: int | None = -1,
         mesh: dict[str, int] | None = None, lineage: dict[str, Any] | None = None,
         serialize_later: bool = False) -> LocalFiles:
    """This rank's small files, taken now: per-rank state (per data-parallel rank ``dp_rank``; -1: ``rank``; None:
    none), on rank 0 also global state, config, losses, metadata, then ``write_after``."""
    if dp_rank == -1:
        dp_rank = rank
    per_rank = plan.per_rank if dp_rank is not None else {}
    take = _taken if serialize_later else _pt_bytes
    out = LocalFiles(staging, {staging / layout.rank_state_file(a, dp_rank): take(o) for a, o in per_rank.items()})
    if rank != 0:
        return out
    out.files |= {staging / layout.global_state_file(a): take(o) for a, o in plan.global_.items()}
    out.files[staging / layout.CONFIG_FILE] = config_yaml.encode("utf-8")
    losses = {"epoch": info.epoch, "step": info.step, "train_loss": info.train_loss, "val_loss": info.val_loss}
    out.files[staging / layout.LOSSES_FILE] = (json.dumps(losses, indent=2) + "\n").encode("utf-8")
    out.metadata = build_metadata(
        name=staging.name[len(layout.STAGING_PREFIX):], epoch=info.epoch, step=info.step,
        train_loss=info.train_loss, val_loss=info.val_loss, is_final=info.is_final, extra=info.extra,
        world_size=world_size, model_save_format=model_save_format, training_seconds=training_seconds,
        fingerprint=fingerprint, mesh=mesh)
    lineage = out.metadata.get("extra", {}).pop("lineage", lineage)  # a tool's own (an import's) wins
    if not out.metadata.get("extra", True):
        del out.metadata["extra"]
    if lineage is not None:
        out.metadata["lineage"] = lineage  # where it came from: its parents by path and fingerprint (export/lineage)
    out.write_after = write_after
    return out


def _pt_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj.state_dict(), buffer)
    return buffer.getvalue()


def _taken(obj: Any) -> Taken:
    return Taken(obj.state_dict())


def write_files(files: dict[Path, bytes | Taken]) -> None:
    for path, data in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data.bytes() if isinstance(data, Taken) else data)
