"""Saves and restores a recipe's discovered state as one checkpoint folder, on every rank together."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from automodel_ckpt.checkpoint import storage
from automodel_ckpt.checkpoint.config import CheckpointConfig
from automodel_ckpt.checkpoint.cycle import Restored, SaveCycle, SaveObserver, States, StepEnded
from automodel_ckpt.ondisk.info import HFArtifacts, SaveInfo
from automodel_ckpt.checkpoint.local_tier import LocalTier
from automodel_ckpt.checkpoint.restore import fallback, initial_weights, resume
from automodel_ckpt.checkpoint.restore.fallback import DURABLE
from automodel_ckpt.checkpoint.restore.loader import CheckpointLoader, Loaded
from automodel_ckpt.checkpoint.save import overlap
from automodel_ckpt.checkpoint.save.phases import TrainingTime
from automodel_ckpt.checkpoint.save.settings import WriteSettings
from automodel_ckpt.checkpoint.save.writer import SaveWriter
from automodel_ckpt.checkpoint.storage.runlock import RunLock
from automodel_ckpt.checkpoint.triggers import PreemptionWatcher, Steps
from automodel_ckpt.distributed.env import DistEnv
from automodel_ckpt.distributed.mesh import ParallelDims

ABANDON_WAIT_SECONDS = 60.0  # how long a failing run waits for its background checkpoint writes


class Checkpointer:
    """Writes ``epoch_E_step_N/`` (see ``layout``) from discovered state and restores state from it.

    Always present in a recipe: with ``checkpoint.enabled: false`` a save is a no-op (returns None) and a restore
    still carries out an explicit ``restore_from``. The run folder (``storage``) is opened once; the save steps
    live in ``save/`` (``SaveWriter``), the load steps in ``restore/`` (each tier chooses, ``CheckpointLoader``
    loads).

    A recipe makes four calls: ``resume`` (before training), ``step_end`` (after each optimizer step: it decides
    what to save, by steps, minutes, the preemption signal or the node-local tier, and saves it; ``cycle``),
    ``fence`` (before changing saved tensors in place) and ``finalize`` (at the end, or ``failed=True`` when an
    error ends the run).
    """

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
        side_failure: Callable[[str, str, int], None] | None = None,
        preemption: PreemptionWatcher | None = None,
        observer: SaveObserver | None = None,
    ) -> None:
        self.cfg = cfg
        self.env = env
        # Per-rank files (data position, RNG) are per data-parallel rank, written by its first tensor-parallel rank.
        self.dims = dims or ParallelDims.single(env.rank, env.world_size)
        self.fingerprint = fingerprint  # recorded in every checkpoint; resume compares (ondisk/fingerprint.py)
        self.say = say
        self.run = storage.open_run_folder(cfg, env.rank, env.world_size)  # local folder or object store: once
        self.dir = self.run.local  # the local folder: checkpoint_dir itself, or an object store's mirror
        self.loaded_states: tuple[str, ...] = ()  # what the last restore loaded (the recipe fills the rest itself)
        self.restored_tier: str | None = None  # "local" or "durable": where the last restore loaded from
        self.restore_seconds = 0.0  # how long the last restore took (finding, checking and loading)
        self._time = TrainingTime()
        hf = hf or HFArtifacts()
        if side_failure is None and observer is not None:
            side_failure = observer.side_failure
        self._writer = SaveWriter(WriteSettings.durable(cfg), env, self.dims, self.run,
                                  config_yaml=resolved_config_yaml, hf=hf, fingerprint=fingerprint, time=self._time,
                                  say=say, side_failure=side_failure)
        self._loader = CheckpointLoader(cfg, env, self.dims, self.run, say)
        if self.enabled:  # fail before training, not at the first save: writable, one run per folder, credentials
            self.run.acquire()
        self._local = LocalTier(cfg, env, self.dims, config_yaml=resolved_config_yaml, hf=hf,  # checkpoint.local
                                fingerprint=fingerprint, time=self._time, say=say)
        self._cycle = SaveCycle(self, cfg.ckpt_every_minutes, preemption, observer)

    @property
    def enabled(self) -> bool:
        """Whether this run saves checkpoints (``checkpoint.enabled``)."""
        return bool(self.cfg.enabled)

    @property
    def lock(self) -> RunLock:
        """The run folder's lock: held (by rank 0) from the start until ``finalize``, when saving is enabled."""
        return self.run.lock

    # ------------------------------------------------------------------------------------------ save
    def step_end(self, states: States, steps: Steps, *, epoch: int, loss: float,
                 extra: Callable[[], dict[str, Any]] | None = None, validate: Callable[[], float] | None = None,
                 validate_now: bool = False) -> StepEnded:
        """After optimizer step ``steps.step``, on every rank: decide what to save and save it (``cycle``).

        A durable checkpoint on the step schedule (``steps.is_ckpt_step``), every ``ckpt_every_minutes`` or on the
        preemption signal; else a node-local step when one is due. ``states()`` is the discovered state and
        ``extra()`` what the checkpoint's metadata records, both asked only for a save; ``validate()`` runs when
        ``validate_now`` or before a scheduled save (whose metadata then holds the validation loss). Collective.
        """
        return self._cycle.step_end(states, steps, epoch=epoch, loss=loss, extra=extra, validate=validate,
                                    validate_now=validate_now)

    def save(self, states: dict[str, Any], info: SaveInfo) -> Path | None:
        """Save ``states`` as ``epoch_E_step_N/``; returns its path (None when checkpointing is disabled).

        Synchronous: the checkpoint is complete and published when this returns. With ``is_async`` this returns
        at once: small states and small tensors are copied now; a background thread copies the model and optimizer
        tensors (the next ``optimizer.step()`` waits for that copy: ``fence``), writes the copy, then completes the
        checkpoint (sync, seal, publish, prune; with an inline HF export: the next ``save`` or ``finalize`` does).
        A save that runs out of room removes its staging folder and raises ``DiskFullError`` (``diskfull``).
        """
        if not self.enabled:
            return None
        return self._writer.write_checkpoint(states, info)

    def local_due(self, step: int) -> bool:
        """Whether a node-local step is due after optimizer step ``step`` (``checkpoint.local.every_steps``)."""
        return self._local.due(step)

    def save_local(self, states: dict[str, Any], info: SaveInfo) -> Path | None:
        """Take a node-local step of ``states``: the call returns once the state is copied; writing it, its
        copies on other nodes and its commit run in the background (``local_tier``). None when the tier is off, and
        when the step is skipped or abandoned: a local step that cannot be written never stops training (a warning
        says so, ``local_faults``)."""
        return self._local.save(states, info)

    def local_faults(self) -> list[str]:
        """The lines said since the last call about node-local steps abandoned (a step that could not be written:
        training goes on) or written again after that; empty on ranks other than 0. For the trackers and the
        end-of-run report."""
        return self._local.faults()

    @property
    def local_steps_abandoned(self) -> int:
        """How many node-local steps this launch abandoned (each said in one warning line)."""
        return self._local.steps_abandoned

    def fence(self) -> None:
        """Wait until the async save in flight has copied the live model and optimizer state (if it has not yet).

        Call before changing saved tensors in place; ``optimizer.step()`` of a checkpointed optimizer calls it by
        itself (a step pre-hook installed by ``save``). Cheap when nothing is in flight.
        """
        self._writer.fence()
        self._local.fence()

    def wait(self) -> Path | None:
        """Wait for the async save in flight, if any, to be complete; returns its path once published.

        Collective. A failure of the background work on any rank raises one ``CheckpointError`` on every rank;
        the unfinished checkpoint is then never published (its staging folder is removed by the next save).
        """
        return self._writer.wait()

    def finalize(self, *, failed: bool = False) -> Path | None:
        """End of training: complete the save in flight (``wait``); release staging buffers, folder lock, lease.

        ``failed=True`` (an error ends the run): ``abandon`` instead, without collectives and without publishing.
        """
        if failed:
            self.abandon()
            return None
        return self._cycle.finalize(self._finalize)

    def _finalize(self) -> Path | None:
        done = False
        try:
            self._local.wait()  # a node-local step that failed is abandoned there (a warning), never raised
            path = self.wait()
            done = True
        finally:
            self._writer.close()
            self._local.finalize(done=done)  # a finished run removes its node-local steps
            self.run.release(keep_lock=not done)  # the next run may take the folder (a failed run: at its exit)
        return path

    def abandon(self) -> None:
        """Training failed: let this rank's background writes end, without collectives and without publishing.

        The wait is bounded by ``ABANDON_WAIT_SECONDS`` in all: a write whose peer rank has died would otherwise
        block until the collective timeout (30 minutes by default). Writes still running then are left to the
        process exit; their staging buffers are not released under them.
        """
        self._writer.abandon(ABANDON_WAIT_SECONDS)
        self._local.abandon(ABANDON_WAIT_SECONDS)  # its node-local steps stay for the restart
        self.run.release(keep_lock=True)  # an object store's lease: the next run need not wait for it to expire

    @property
    def is_async(self) -> bool:
        """Whether saves copy now and write in the background (``checkpoint.is_async``, where torch allows)."""
        return self._writer.is_async

    @property
    def background(self) -> overlap.Overlapped | None:
        """The background work of the async save in flight (fence wait, copy time, writes, completion), or None."""
        return self._writer.background

    @property
    def in_flight(self) -> bool:
        """Whether an async save is still to be completed by ``wait``/``finalize``."""
        return self._writer.in_flight

    @property
    def last_save_seconds(self) -> dict[str, float]:
        """Where the last ``save`` call spent its time, by phase (``save.phases``)."""
        return self._writer.last_save_seconds

    @property
    def last_complete_seconds(self) -> dict[str, float]:
        """The same for the steps after the model and optimizer files were written."""
        return self._writer.last_complete_seconds

    @property
    def resumed_from(self) -> str | None:
        """The name of the checkpoint this run resumed from (retention on an object store keeps it)."""
        return self._writer.resumed_from

    # ------------------------------------------------------------------------------------------ restore
    def resume(self, states: dict[str, Any]) -> Restored:
        """``restore``, then training begins (``ckpt_every_minutes`` count from now): what was loaded, from where."""
        path = self.restore(states)
        self._cycle.start()
        if path is None:
            return Restored(None)
        return Restored(path, self.loaded_states, self.restored_tier, self.restore_seconds)

    def restore(self, states: dict[str, Any]) -> Path | None:
        """Restore what ``checkpoint.restore_from`` selects into ``states``; returns the checkpoint, or None (fresh).

        Auto-resume falls back past damaged checkpoints and refuses another run's checkpoints; ``load_only``
        starts a new run from a checkpoint's (or an HF / adapter folder's) weights. One loop
        (``restore.fallback``) asks each tier in turn (node-local, durable, the weights-only start) to choose, loads,
        and falls back.
        """
        started = time.perf_counter()
        rank, world_size = self.env.rank, self.env.world_size
        tiers: list[fallback.Tier] = []
        if self._local.active and self.cfg.restore_from is None and not self.cfg.load_only:
            tiers.append(self._local.recovery(self.run.find(None)))  # first, when newer than the durable newest
        tiers.append(resume.DurableTier(self.cfg, self.run, self._loader, rank=rank, world_size=world_size,
                                        fingerprint=self.fingerprint, say=self.say))
        if self.cfg.load_only:  # when the run has no checkpoint of its own
            tiers.append(initial_weights.StartTier(self.cfg, self.run, self._loader, states, rank=rank,
                                                   world_size=world_size, say=self.say))
        tier, loaded = fallback.first_loaded(tiers, states) or (DURABLE, None)
        return self._took(loaded, tier, started)

    def load(self, states: dict[str, Any], path: Path) -> None:
        """Load ``states`` from checkpoint ``path`` (fetched and checked first) on every rank, as a resume would."""
        self._took(self._loader.load(states, Path(path)), DURABLE, time.perf_counter())

    def _took(self, loaded: Loaded | None, tier: str, started: float) -> Path | None:
        """Record what a restore loaded: its states, its tier and time; for a resumed run its name and training
        time."""
        if loaded is None:
            return None
        self.loaded_states, self.restored_tier = loaded.states, tier
        self.restore_seconds = time.perf_counter() - started
        if loaded.continues_run:
            self._writer.resumed_from = loaded.path.name
        if loaded.training_seconds is not None:
            self._time.restart(loaded.training_seconds)
        return loaded.path
