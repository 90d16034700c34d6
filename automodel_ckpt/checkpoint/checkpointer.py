"""Saves and restores a recipe's discovered state as one checkpoint folder, on every rank together."""

from __future__ import annotations

import logging
import time
import warnings
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch

from automodel_ckpt.checkpoint import collective, storage
from automodel_ckpt.checkpoint.config import CheckpointConfig
from automodel_ckpt.checkpoint.disk import catalog, layout, manifest, metadata
from automodel_ckpt.checkpoint.disk.durable import WrittenFiles, fsync_tree
from automodel_ckpt.checkpoint.disk.loadcheck import DamagedFile, LoadCheck, deferred, finish_collectively
from automodel_ckpt.checkpoint.disk.metadata import read_metadata
from automodel_ckpt.checkpoint.disk.retention import RetentionPolicy, render_name
from automodel_ckpt.checkpoint.formats import peft as peft_format
from automodel_ckpt.checkpoint.formats import sharded
from automodel_ckpt.checkpoint.formats.detect import detect_model_format
from automodel_ckpt.checkpoint.formats.safe_load import load_pt
from automodel_ckpt.checkpoint.info import HFArtifacts, SaveInfo
from automodel_ckpt.checkpoint.restore import initial_weights, resume
from automodel_ckpt.checkpoint.restore.decision import CHECKPOINT, Decision
from automodel_ckpt.checkpoint.save import diskfull, lifecycle, local_files, overlap
from automodel_ckpt.checkpoint.save.phases import PhaseClock
from automodel_ckpt.checkpoint.state import StatePlan, plan_state
from automodel_ckpt.checkpoint.storage.runlock import RunLock
from automodel_ckpt.distributed.env import DistEnv, barrier, collectives_on
from automodel_ckpt.distributed.lifeline import stop_if_orphaned
from automodel_ckpt.distributed.mesh import ParallelDims
from automodel_ckpt.errors import CheckpointError, first_line, warn

logger = logging.getLogger(__name__)
T = TypeVar("T")

ABANDON_WAIT_SECONDS = 60.0  # how long a failing run waits for its background checkpoint writes


class Checkpointer:
    """Writes ``epoch_E_step_N/`` (see ``layout``) from discovered state and restores state from it."""

    loaded_states: tuple[str, ...] = ()  # what the last restore loaded (the recipe fills the rest itself)

    def __init__(
        self,
        cfg: CheckpointConfig,
        env: DistEnv,
        *,
        resolved_config_yaml: str,
        hf: HFArtifacts | None = None,
        say: Callable[[str], None] = print,
        fingerprint: dict[str, Any] | None = None,
        dims: ParallelDims | None = None,
    ) -> None:
        self.cfg = cfg
        # Per-rank files (data position, RNG) are per data-parallel rank, written by its first tensor-parallel rank.
        self.dims = dims or ParallelDims.single(env.rank, env.world_size)
        self.fingerprint = fingerprint  # recorded in every checkpoint; resume compares (checkpoint/disk/fingerprint.py)
        self.env = env
        self.run = storage.open_run_folder(cfg, env.rank, env.world_size)  # local folder or object store: once
        self.dir = self.run.local  # the local folder: checkpoint_dir itself, or an object store's mirror
        self.monitor = storage.monitor_of(cfg)  # "best by monitor": LOWEST_VAL
        self.resumed_from: str | None = None  # the checkpoint this run resumed from (retention on a store keeps it)
        self.resolved_config_yaml = resolved_config_yaml
        self.hf = hf or HFArtifacts()
        self.say = say
        self._warned_torch_save_consolidation = False
        self._warned_peft_format = False
        self.retention = RetentionPolicy.from_config(cfg)
        self._started = time.monotonic()
        self._seconds_before = 0.0  # training seconds recorded in the restored checkpoint
        self.is_async = bool(cfg.is_async) and cfg.enabled and overlap.async_supported(env.is_main)
        self._pending: overlap.PendingSave | None = None  # the async save still being written (at most one)
        self._saved_objects: list[Any] = []  # the state of the last save (its size is reported on a full disk)
        self._stager = None
        self._fences: dict[int, Any] = {}  # id(optimizer) -> its step pre-hook handle (see ``fence``)
        self.write_threads = cfg.async_write_threads or overlap.default_write_threads()
        self.written = WrittenFiles()  # files this checkpointer wrote: fsynced already, checksum known
        self._group = None  # checkpointing's own process group: background writes never meet training collectives
        self.last_save_seconds: dict[str, float] = {}  # where the last save call spent its time, by phase
        self.last_complete_seconds: dict[str, float] = {}  # the same for the steps after the shards were written
        if self.is_async:  # collective: every rank creates it, in the same order
            import torch.distributed as dist

            self._group = dist.new_group(backend="gloo")
        if cfg.enabled:  # fail before training, not at the first save: writable, one run per folder, credentials
            self.run.acquire()

    @property
    def lock(self) -> RunLock:
        """The run folder's lock: held (by rank 0) from the start until ``finalize``, when saving is enabled."""
        return self.run.lock

    # ------------------------------------------------------------------------------------------ save
    @diskfull.guarded
    def save(self, states: dict[str, Any], info: SaveInfo) -> Path:
        """Save ``states`` as ``epoch_E_step_N/``; returns its path.

        Synchronous: the checkpoint is complete and published when this returns. With ``is_async`` this returns
        at once: small states and small tensors are copied now; a background thread copies the model and optimizer
        tensors (the next ``optimizer.step()`` waits for that copy: ``fence``), writes the copy, then completes the
        checkpoint (sync, seal, publish, prune; with an inline HF export: the next ``save`` or ``finalize`` does).
        A save that runs out of room removes its staging folder and raises ``DiskFullError`` (``diskfull``).
        """
        self._saved_objects = list(states.values())
        clock = PhaseClock()
        self.wait()  # at most one save in flight: finish (and publish) the previous one first
        clock.mark("complete_previous")
        name = render_name(  # every name is checked, before anything is created: ConfigError on every rank
            self.cfg.name_template, info.epoch, info.step, consumed_samples=info.extra.get("consumed_samples"),
            train_loss=info.train_loss, val_loss=info.val_loss,
        )
        final = self.dir / name
        rank = self.env.rank
        if self.env.is_main:
            self.say(f"Saving checkpoint to {self.run.location(name)}")
        plan = plan_state(states)
        consolidate = self._consolidate_now(info, plan)

        def reserve() -> Path:
            return collective.on_main(lambda: self.run.reserve(name), "reserving the checkpoint", rank)

        # async: the background thread reserves the staging folder (after the copy), unless something is written
        # into it now (a PEFT adapter) or the save completes on this thread (an inline HF export)
        reserve_later = (self.is_async and not consolidate and not plan.has_peft
                         and self.run.reserves_in_background and bool(plan.models or plan.optimizers))
        staging = self.dir / layout.staging_name(name) if reserve_later else reserve()
        clock.mark("reserve")
        fmt = self.cfg.model_save_format
        staged: list[sharded.StagedSave] = []  # async: copied now, written in the background below
        for attr, model in plan.models.items():  # collective; DCP raises on every rank if any rank fails
            if peft_format.is_peft_model(model):  # adapters: always written now, by rank 0
                self._save_adapter(model, staging / layout.state_dir(attr))
            elif self.is_async:
                staged.append(sharded.stage_model(model, staging / layout.state_dir(attr), fmt, self._host_stager(),
                                                  self.written, threads=self.write_threads))
            else:
                sharded.save_model(model, staging / layout.state_dir(attr), fmt, written=self.written)
        for attr, optim in plan.optimizers.items():
            if self.is_async:
                staged.append(sharded.stage_optimizer(plan.model_for(attr), optim, staging / layout.state_dir(attr),
                                                      self._host_stager(), self.written, threads=self.write_threads))
                self._install_fence(optim)
            else:
                sharded.save_optimizer(plan.model_for(attr), optim, staging / layout.state_dir(attr),
                                       written=self.written)
        clock.mark("copy_small" if staged else "write_sharded")
        write_local = self._local_files(staging, plan, info)
        pending = overlap.PendingSave(name, staging, consolidate=consolidate)
        background = bool(staged) and not consolidate  # small files, sync, seal, publish, prune: in the background
        if not background:
            collective.collectively(write_local.write, f"writing '{staging}'", rank)
        clock.mark("write_local")
        if staged:  # captured, written one at a time (then completed), on the checkpoint group by one thread
            prepare = (lambda: self._on_group(reserve)) if reserve_later else None
            then = (lambda: self._on_group(lambda: self._complete(pending, write_local))) if background else None
            pending.job = overlap.start(staged, self._group, nice=self.cfg.async_nice, prepare=prepare, then=then)
            pending.writes = [(future, item.path) for future, item in zip(pending.job.writes, staged)]
        if pending.writes:
            clock.mark("start_background")
            self._pending = pending
            self.last_save_seconds = clock.phases
            return final
        path = self._complete(pending)
        clock.mark("complete")
        self.last_save_seconds = clock.phases
        return path

    def fence(self) -> None:
        """Wait until the async save in flight has copied the live model and optimizer state (if it has not yet).

        Call before changing saved tensors in place; ``optimizer.step()`` of a checkpointed optimizer calls it by
        itself (a step pre-hook installed by ``save``). Cheap when nothing is in flight.
        """
        pending = self._pending
        if pending is not None and pending.job is not None:
            pending.job.fence()

    def _install_fence(self, optimizer: Any) -> None:
        if id(optimizer) not in self._fences and hasattr(optimizer, "register_step_pre_hook"):
            self._fences[id(optimizer)] = optimizer.register_step_pre_hook(lambda *_: self.fence())

    @diskfull.guarded
    def wait(self) -> Path | None:
        """Wait for the async save in flight, if any, to be complete; returns its path once published.

        Collective. A failure of the background work on any rank raises one ``CheckpointError`` on every rank;
        the unfinished checkpoint is then never published (its staging folder is removed by the next save).
        """
        pending, self._pending = self._pending, None
        if pending is not None and pending.job is not None and pending.job.completed is not None:
            return pending.job.completed.result()  # published in the background (or failed there, on every rank)
        return self._complete(pending) if pending is not None else None

    def _on_group(self, fn: Callable[[], T]) -> T:
        """``fn`` with its collectives on checkpointing's own group: the background thread's never meet training's."""
        with collectives_on(self._group):
            return fn()

    def finalize(self) -> Path | None:
        """End of training: complete the save in flight (``wait``); release staging buffers, folder lock, lease."""
        done = False
        try:
            path = self.wait()
            done = True
        finally:
            self._close_stager()
            self.run.release(keep_lock=not done)  # the next run may take the folder (a failed run: at its exit)
        return path

    def abandon(self) -> None:
        """Training failed: let this rank's background writes end, without collectives and without publishing.

        The wait is bounded by ``ABANDON_WAIT_SECONDS`` in all: a write whose peer rank has died would otherwise
        block until the collective timeout (30 minutes by default). Writes still running then are left to the
        process exit; their staging buffers are not released under them.
        """
        pending, self._pending = self._pending, None
        if pending is None or pending.let_end(ABANDON_WAIT_SECONDS):
            self._close_stager()
        self.run.release(keep_lock=True)  # an object store's lease: the next run need not wait for it to expire

    @property
    def background(self) -> overlap.Overlapped | None:
        """The background work of the async save in flight (fence wait, copy time, writes, completion), or None."""
        pending = self._pending
        return pending.job if pending is not None else None

    @property
    def in_flight(self) -> bool:
        """Whether an async save is still to be completed by ``wait``/``finalize``."""
        return self._pending is not None

    def _host_stager(self) -> sharded.HostStager:
        if self._stager is None:
            self._stager = sharded.HostStager()
        return self._stager

    def _close_stager(self) -> None:
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        for handle in self._fences.values():
            handle.remove()
        self._fences.clear()
        self.written = WrittenFiles()  # files this checkpointer wrote: fsynced already, checksum known

    def _complete(self, pending: overlap.PendingSave, write_local: local_files.LocalFiles | None = None) -> Path:
        """The steps after the model and optimizer files are written: the small files (``write_local``, when not
        written yet), consolidate, fsync, manifest, publish, prune."""
        rank, staging, name = self.env.rank, pending.staging, pending.name
        if pending.writes:
            def wait_writes() -> None:  # every write ends before any failure is raised: none outlives the save
                errors = []
                for future, folder in pending.writes:
                    try:
                        sharded.wait_async_save(future, folder)
                    except Exception as exc:  # noqa: BLE001 - raised below, after the other writes ended
                        errors.append(exc)
                if errors:
                    raise errors[0]

            collective.collectively(wait_writes, f"writing '{staging}' in the background", rank)
        if write_local is not None:
            collective.collectively(write_local.write, f"writing '{staging}'", rank)
        clock = PhaseClock()
        if pending.consolidate:
            collective.collectively(lambda: self._consolidate(staging), "consolidating the checkpoint", rank)
            clock.mark("consolidate")
        collective.collectively(lambda: fsync_tree(staging, rank, self.env.world_size, self.written), f"syncing '{staging}'", rank)
        clock.mark("sync")
        manifest.seal(staging, rank, self.env.world_size, self.written)  # manifest.json, written last and fsynced
        clock.mark("manifest")
        stop_if_orphaned(f"publishing '{name}'")  # a worker that outlived its launcher never publishes
        publish = lambda: lifecycle.publish(self.dir, name, update_lowest_val=self._is_new_best(staging))  # noqa: E731
        if self.run.upload(staging, name):  # an object store: every rank's share, before the commit
            clock.mark("upload")
        path = self.run.commit(staging, name, publish)
        if self.retention.prunes:
            self._prune()
        barrier()
        clock.mark("publish")
        self.last_complete_seconds = clock.phases
        return path

    def _prune(self) -> None:
        """Apply the retention rules on rank 0; a failure is a warning, the checkpoint just saved stands."""
        try:
            deleted = collective.on_main(self._prune_on_main, "pruning old checkpoints", self.env.rank)
        except CheckpointError as exc:
            if self.env.is_main:
                warnings.warn(f"checkpoint retention: {exc}", stacklevel=3)
            return
        if deleted and self.env.is_main:
            self.say(f"Removed checkpoints by retention: {', '.join(deleted)}")

    def _prune_on_main(self) -> list[str]:
        return self.run.prune(self.retention, self.monitor, self.resumed_from)

    def _local_files(self, staging: Path, plan: StatePlan, info: SaveInfo) -> local_files.LocalFiles:
        """This rank's small files (``local_files``), their contents taken now; on rank 0 with the HF helpers."""
        peft = plan.has_peft
        helpers = (lambda: self._write_hf_helpers(staging / layout.MODEL_DIR)) if plan.models and not peft else None
        return local_files.take(
            staging, plan, info, rank=self.env.rank, world_size=self.env.world_size,
            dp_rank=self.dims.dp_rank if self.dims.writes_rank_state else None, mesh=self.dims.sizes.record(),
            config_yaml=self.resolved_config_yaml,
            model_save_format=layout.ADAPTER_FORMAT if peft else self.cfg.model_save_format,
            training_seconds=self._seconds_before + time.monotonic() - self._started,
            fingerprint=self.fingerprint, then=helpers,
        )

    def _write_hf_helpers(self, model_dir: Path) -> None:
        from automodel_ckpt.checkpoint.export.script import render_consolidate_script
        from automodel_ckpt.checkpoint.export.hf_metadata import write_hf_metadata

        write_hf_metadata(
            model_dir,
            hf_config=self.hf.hf_config,
            generation_config=self.hf.generation_config,
            tokenizer=self.hf.tokenizer,
            base_model_path=self.hf.base_model_path,
        )
        if self.cfg.model_save_format == sharded.SAFETENSORS:  # torch_save exports with `ckpt-train consolidate`
            render_consolidate_script(model_dir)

    def _save_adapter(self, model: Any, folder: Path) -> None:
        """PEFT model: a Hugging Face adapter folder whatever ``model_save_format`` says (formats/peft.py)."""
        if self.cfg.model_save_format != sharded.SAFETENSORS and self.env.is_main and not self._warned_peft_format:
            warnings.warn(f"checkpoint.model_save_format={self.cfg.model_save_format} does not apply to PEFT models; "
                          "saving the adapter in Hugging Face PEFT format (safetensors)", stacklevel=3)
            self._warned_peft_format = True
        peft_format.save_adapter(model, folder, rank=self.env.rank, base_model_path=self.hf.base_model_path,
                                 tokenizer=self.hf.tokenizer, peft_section=self.hf.peft)

    def _consolidate_now(self, info: SaveInfo, plan: StatePlan) -> bool:
        mode = self.cfg.save_consolidated
        wanted = mode == "every" or (mode == "final" and info.is_final)
        if not wanted or not plan.models:
            return False
        if plan.has_peft:  # the adapter folder is already Hugging Face-ready; `ckpt-train merge-lora` merges it
            if self.env.is_main:
                logger.info("save_consolidated does not apply to PEFT checkpoints; the adapter is saved HF-ready")
            return False
        if self.cfg.model_save_format != sharded.SAFETENSORS:
            if self.env.is_main and not self._warned_torch_save_consolidation:
                warnings.warn(
                    f"checkpoint.save_consolidated={mode} needs model_save_format=safetensors; skipping the inline "
                    "HF export (run `ckpt-train consolidate CHECKPOINT` later to export this checkpoint)",
                    stacklevel=2,
                )
                self._warned_torch_save_consolidation = True
            return False
        return True

    def _consolidate(self, staging: Path) -> None:
        from automodel_ckpt.checkpoint.export.plan import consolidate

        consolidate(
            staging / layout.MODEL_DIR,
            rank=self.env.rank,
            world_size=self.env.world_size,
            progress=False,
        )

    def _is_new_best(self, staged: Path) -> bool:
        """Rank 0: whether the staged checkpoint beats LOWEST_VAL's target by ``checkpoint.monitor``.

        Both values are read from the checkpoints' metadata on disk, so a restarted run compares against the best
        of every earlier run. LOWEST_VAL means "best by monitor": with ``mode: max`` it follows the highest value.
        Non-finite values never win.
        """
        best = catalog.pointer_target(self.dir, layout.LOWEST_VAL)
        return self.monitor.beats(read_metadata(staged), read_metadata(best) if best else None)

    # ------------------------------------------------------------------------------------------ load
    def restore(self, states: dict[str, Any]) -> Path | None:
        """Restore what ``checkpoint.restore_from`` selects into ``states``; returns the checkpoint, or None (fresh).

        Auto-resume falls back past damaged checkpoints and refuses another run's checkpoints; ``load_only``
        starts a new run from a checkpoint's (or an HF / adapter folder's) weights. ``restore.resume`` decides,
        this carries it out (``carry_out``).
        """
        peft = "model" in states and peft_format.is_peft_model(states["model"])
        touched = None  # a checkpoint found damaged while loading it: some state already holds its bytes
        while True:
            decision = resume.decide(self.cfg, self.run, states, model_is_peft=peft, rank=self.env.rank,
                                     world_size=self.env.world_size, fingerprint=self.fingerprint, say=self.say,
                                     touched=touched)
            try:
                return self.carry_out(decision, states)
            except DamagedFile as exc:  # a checksum computed while loading (verify_on_load): as if found by probe
                if not decision.fallback or decision.path is None:
                    raise
                resume.set_aside(self.run, decision.path, exc, rank=self.env.rank, say=self.say)
                touched = first_line(exc)

    def carry_out(self, decision: Decision, states: dict[str, Any]) -> Path | None:
        """Load what ``decision`` names into ``states`` on every rank; returns its path, or None (a fresh run)."""
        if decision.path is None:
            return None
        subset = states if decision.states is None else {name: states[name] for name in decision.states}
        if decision.kind == CHECKPOINT:
            self.load(subset, decision.path, checked=True, fresh_run=decision.fresh_run)
        else:
            if self.env.is_main:
                self.say(f"Loading model weights from {decision.kind} {decision.path}")
            initial_weights.load_weights(subset["model"], decision, self.env.rank)
        self.loaded_states = tuple(subset)
        if decision.fresh_run and self.env.is_main:
            self.say(f"Started from {', '.join(decision.states or ())} of {decision.path}; everything else starts "
                     "fresh")
        return decision.path

    def find_restore_target(self, restore_from: str | None = None, *, auto: bool | None = None) -> Path | None:
        """The checkpoint to restore (as decided by rank 0), or None to start fresh.

        ``restore_from`` defaults to ``checkpoint.restore_from``; ``auto=True`` asks for the latest checkpoint.
        """
        if auto is None and not self.cfg.enabled and self.cfg.restore_from is None:
            return None
        return self.run.find(None if auto else (restore_from or self.cfg.restore_from))

    def fetch(self, path: Path) -> None:
        """Collective: an object store's checkpoint is downloaded into its mirror before it is checked and loaded."""
        self.run.fetch(Path(path))

    def load(self, states: dict[str, Any], path: Path, *, checked: bool = False, fresh_run: bool = False) -> None:
        """Load ``states`` from checkpoint ``path`` on every rank.

        ``checked``: the files were already checked against the manifest (``restore.probe``). ``fresh_run``: the
        states start a new run (``load_only``), so the training time recorded in the checkpoint does not carry over.
        """
        with sharded.reading():  # the reader threads start now, beside the checks and the planning
            self._load(states, Path(path), checked, fresh_run)

    def _load(self, states: dict[str, Any], path: Path, checked: bool, fresh_run: bool) -> None:
        if self.env.is_main:
            self.say(f"Loading checkpoint from {self.run.where(path)}")
        if not checked:
            self.fetch(path)
            collective.collectively(
                lambda: manifest.check_before_load(path, checksums=self.cfg.verify_on_load, rank=self.env.rank,
                                                   world_size=self.env.world_size, warn=warn, leave=deferred),
                "verifying the checkpoint", self.env.rank,
            )
        plan = plan_state(states)
        if not fresh_run:
            self.resumed_from = path.name
            self._seconds_before = float((read_metadata(path) or {}).get("training_seconds") or 0.0)
        self._started = time.monotonic()
        check = LoadCheck.plan(path, self.env.rank, self.env.world_size) if self.cfg.verify_on_load else None
        for attr, model in plan.models.items():
            folder = self._require(path / layout.state_dir(attr))
            if peft_format.is_peft_model(model):
                peft_format.load_adapter(model, folder)
            else:
                sharded.load_model(model, folder, detect_model_format(folder) or sharded.TORCH_SAVE, check=check)
        for attr, optim in plan.optimizers.items():
            folder = self._require(path / layout.state_dir(attr))
            sharded.load_optimizer(plan.model_for(attr), optim, folder, check=check)
        if self.cfg.verify_on_load:  # the deferred files no load above read
            finish_collectively(check, self.env.rank)
        for attr, obj in plan.global_.items():
            file = path / layout.global_state_file(attr)
            if not file.exists():
                self._missing_state(attr, file)
                continue
            obj.load_state_dict(load_pt(file))
        saved_dp = self.saved_mesh(path).dp  # per-rank files are per data-parallel rank
        dp_rank, dp_size = self.dims.dp_rank, self.dims.dp_size
        for attr, obj in plan.per_rank.items():
            file = path / layout.rank_state_file(attr, dp_rank)
            if saved_dp != dp_size and hasattr(obj, "reshard_state"):
                state = obj.reshard_state(
                    lambda r, attr=attr: load_pt(path / layout.rank_state_file(attr, r)),
                    saved_dp, dp_rank, dp_size,
                )
                obj.load_state_dict(state)
            elif not file.exists():
                self._missing_state(attr, file)
            else:
                obj.load_state_dict(load_pt(file))
        barrier()

    saved_world_size = staticmethod(metadata.saved_world_size)
    saved_mesh = staticmethod(metadata.saved_mesh)
    written_by = staticmethod(metadata.written_by)

    def _require(self, folder: Path) -> Path:
        if not folder.is_dir():
            raise CheckpointError(f"checkpoint is missing '{folder}'")
        return folder

    def _missing_state(self, attr: str, file: Path) -> None:
        if self.env.is_main:
            warnings.warn(f"checkpoint has no state for '{attr}' ({file} missing); '{attr}' starts fresh", stacklevel=3)
