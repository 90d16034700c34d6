"""Saves and restores a recipe's discovered state as one checkpoint folder, on every rank together."""

from __future__ import annotations

import functools
import time
from operator import attrgetter
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
from automodel_ckpt.checkpoint.state import plan_state
from automodel_ckpt.checkpoint.triggers import AutoInterval, PreemptionWatcher, Steps
from automodel_ckpt.distributed.env import DistEnv
from automodel_ckpt.distributed.mesh import ParallelDims

ABANDON_WAIT_SECONDS = 60.0  # how long a failing run waits for its background checkpoint writes


def _step_info(epoch: int, step: int, loss: float, val_loss: float | None,
               extra: Callable[[], dict[str, Any]] | None, final: bool) -> SaveInfo:
    """What a save of a step records, ``extra()`` asked as it is made."""
    return SaveInfo(epoch, step, loss, val_loss, is_final=final, extra=extra() if extra else {})


class CheckpointerStats:
    """What tools and reports read of a checkpointer: its folder, the save in flight, what saves cost."""

    dir = property(attrgetter("_of._run.local"), doc="The run's local folder, or an object store's mirror.")
    is_async = property(attrgetter("_of._writer.is_async"))
    background = property(attrgetter("_of._writer.background"))  # an overlap.Overlapped, or None
    in_flight = property(attrgetter("_of._writer.in_flight"))
    last_save_seconds = property(attrgetter("_of._writer.last_save_seconds"),
                                 doc="Where the last ``save`` call spent its time, by phase (``save.phases``).")
    last_complete_seconds = property(attrgetter("_of._writer.last_complete_seconds"))  # the rest, after the writes
    resumed_from = property(attrgetter("_of._writer.resumed_from"),
                            doc="The checkpoint this run resumed from (retention on an object store keeps it).")
    local_steps_abandoned = property(attrgetter("_of._local.steps_abandoned"))

    def __init__(self, checkpointer: Checkpointer) -> None:
        self._of = checkpointer


class Checkpointer:
    """Writes ``epoch_E_step_N/`` from discovered state and restores state from it; with ``checkpoint.enabled:
    false`` a save is a no-op and a restore still carries out an explicit ``restore_from``.

    A recipe calls ``resume``, ``step_end`` after each optimizer step, ``fence`` before changing saved tensors in
    place and ``finalize`` (``failed=True`` when an error ends the run). Tools also ``save``, ``wait``, ``load``."""

    def __init__(
        self,
        cfg: CheckpointConfig,
        env: DistEnv,
        *,
        resolved_config_yaml: str,
        hf: HFArtifacts | None = None,
        say: Callable[[str], None] = print,
        fingerprint: dict[str, Any] | None = None, stages: Callable[[dict], tuple] | None = None,  # probe.StageRule
        dims: ParallelDims | None = None,
        side_failure: Callable[[str, str, int], None] | None = None,
        interval: AutoInterval | None = None, local_interval: AutoInterval | None = None,  # ``auto`` intervals
        preemption: PreemptionWatcher | None = None,
        observer: SaveObserver | None = None, lineage: Callable[[Path | None], dict[str, Any]] | None = None,
    ) -> None:
        self._cfg, self._env, self._say, self._lineage = cfg, env, say, lineage  # lineage: of what resume loaded
        # Per-rank files (data position, RNG) are per data-parallel rank, written by its first tensor-parallel rank.
        self._dims = dims or ParallelDims.single(env.rank, env.world_size)
        self._fingerprint, self._stages = fingerprint, stages  # in every checkpoint; resume compares (fingerprint.py)
        self._run = storage.open_run_folder(cfg, env.rank, env.world_size)  # local folder or object store: once
        self._restored = Restored(None)
        self._time = TrainingTime()
        self._observer = observer
        self._step = 0  # the last step ended (the final wait's cost is recorded at it)
        self._unsaved: tuple | None = None  # the last step's (states, info maker) where it was not saved durably
        hf = hf or HFArtifacts()
        if side_failure is None and observer is not None:
            side_failure = observer.side_failure
        self._writer = SaveWriter(WriteSettings(cfg), env, self._dims, self._run,
                                  config_yaml=resolved_config_yaml, hf=hf, fingerprint=fingerprint, time=self._time,
                                  say=say, side_failure=side_failure)
        self._loader = CheckpointLoader(cfg, env, self._dims, self._run, say)
        if cfg.enabled:  # fail before training, not at the first save: writable, one run per folder, credentials
            self._run.acquire()
        self._local = LocalTier(cfg, env, self._dims, config_yaml=resolved_config_yaml, hf=hf,  # checkpoint.local
                                fingerprint=fingerprint, time=self._time, say=say, interval=local_interval)
        self._cycle = SaveCycle(cfg.ckpt_every_minutes, preemption, enabled=bool(cfg.enabled),
                                local_due=self._local.due, interval=interval)  # interval: ckpt_every_steps auto
        self.stats = CheckpointerStats(self)

    # ------------------------------------------------------------------------------------------ save
    def step_end(self, states: States, steps: Steps, *, epoch: int, loss: float,
                 extra: Callable[[], dict[str, Any]] | None = None, validate: Callable[[], float] | None = None,
                 validate_now: bool = False) -> StepEnded:
        """Collective, after optimizer step ``steps.step``: a durable checkpoint if due (steps, minutes, preemption),
        else a node-local step if due. ``states()``/``extra()`` are asked only for a save; ``validate()`` runs when
        ``validate_now`` or before a scheduled save."""
        due = self._cycle.decide(steps)
        self._local.tick(steps)
        self._step = step = steps.step
        val_loss = validate() if validate is not None and (validate_now or due.scheduled) else None
        saved = None
        info = functools.partial(_step_info, epoch, step, loss, val_loss, extra)
        if due.durable:
            saved = self._observed_save(functools.partial(self._save_now, states, info(steps.done)), step, due.preempt)
            self._cycle.saved()
        elif due.local:  # node-local: the snapshot only (every_steps auto: decided before it, then timed)
            self._local.timed(steps, self._save_local, states, info(False))
        self._report_local_faults()
        self._unsaved = None if due.durable else (states, info)  # ``finalize(save_last=True)`` saves it
        return StepEnded(saved=saved, val_loss=val_loss, preempted=due.preempt, stop=due.preempt and not steps.done)

    def save(self, states: dict[str, Any], info: SaveInfo) -> Path | None:
        """Save ``states`` as ``epoch_E_step_N/``; its path (None when disabled). Published on return, or with
        ``is_async`` completed in the background (docs/async.md). Out of room: ``DiskFullError``, staging removed."""
        if not self._cfg.enabled:
            return None
        return self._writer.write_checkpoint(plan_state(states), info)

    def _save_local(self, states: dict[str, Any], info: SaveInfo) -> Path | None:
        """A node-local step (``local_tier``); None when off, skipped or abandoned: it never stops training."""
        return self._local.save(states, info)

    def _save_now(self, states: States, info: SaveInfo) -> Path | None:
        return self.save(states(), info)  # looked up at the call: a tool that wraps ``save`` is heard

    def _observed_save(self, save: Callable[[], Path | None], step: int, preemption: bool) -> Path | None:
        """``save()``, timed for the cost report (the observer) and for the save cycle (an ``auto`` interval)."""
        started, observer = time.perf_counter(), self._observer
        path = save() if observer is None else observer.save(save, step, self._background, preemption=preemption)
        self._cycle.blocked_s = time.perf_counter() - started
        return path

    def _background(self) -> overlap.Overlapped | None:
        return self._writer.background

    def _report_local_faults(self) -> None:
        """Node-local steps abandoned or rewritten since the last call, to the observer."""
        if self._observer is not None:
            for line in self._local.faults():
                self._observer.side_failure("local_step", line, self._step)

    def fence(self) -> None:
        """Wait until the async save in flight copied the live state; a checkpointed optimizer's pre-hook calls it."""
        self._writer.fence()
        self._local.fence()

    def wait(self) -> Path | None:
        """Collective: the async save in flight published (its path); a failure on any rank raises on every rank and
        nothing is published."""
        return self._writer.wait()

    def finalize(self, *, failed: bool = False, save_last: bool = False) -> Path | None:
        """End of training: ``wait``, then release buffers, lock and lease; ``failed=True``: ``_abandon``, unless
        ``save_last`` (an error every rank met as the next step began, ``TrainingError.save_last_step``): then the
        last step is saved first where it was not, and the run ends as a finished one (its saves published)."""
        if failed and save_last and self._unsaved is not None:
            states, info = self._unsaved
            self._observed_save(functools.partial(self._save_now, states, info(False)), self._step, False)
        if failed and not save_last:
            self._abandon()
            return None
        if self._observer is None:
            return self._finalize()
        path = self._observer.finalize(self._finalize, self._step)
        self._report_local_faults()
        return path

    def _finalize(self) -> Path | None:
        done = False
        try:
            self._local.wait()  # a node-local step that failed is abandoned there (a warning), never raised
            path = self.wait()
            done = True
        finally:
            self._writer.close()
            self._local.finalize(done=done)  # a finished run removes its node-local steps
            self._run.release(keep_lock=not done)  # the next run may take the folder (a failed run: at its exit)
        return path

    def _abandon(self) -> None:
        """Training failed: wait at most ``ABANDON_WAIT_SECONDS`` for this rank's background writes (one whose peer
        died would block until the collective timeout), with no collectives; later ones are left to the exit."""
        self._writer.abandon(ABANDON_WAIT_SECONDS)
        self._local.abandon(ABANDON_WAIT_SECONDS)  # its node-local steps stay for the restart
        self._run.release(keep_lock=True)  # an object store's lease: the next run need not wait for it to expire

    # ------------------------------------------------------------------------------------------ restore
    def resume(self, states: dict[str, Any]) -> Restored:
        """Restore what ``checkpoint.restore_from`` selects into ``states`` (path None: a fresh start); each tier in
        turn (node-local, durable, ``load_only``'s start) chooses, loads or falls back (``restore.fallback``)."""
        started = time.perf_counter()
        rank, world_size, cfg = self._env.rank, self._env.world_size, self._cfg
        tiers: list[fallback.Tier] = []
        if self._local.active and cfg.restore_from is None and not cfg.load_only:
            tiers.append(self._local.recovery(self._run.find(None)))  # first, when newer than the durable newest
        tiers.append(resume.DurableTier(cfg, self._run, self._loader, rank=rank, world_size=world_size,
                                        fingerprint=self._fingerprint, say=self._say, stages=self._stages))
        if cfg.load_only:  # when the run has no checkpoint of its own
            tiers.append(initial_weights.StartTier(cfg, self._run, self._loader, states, rank=rank,
                                                   world_size=world_size, say=self._say))
        tier, loaded = fallback.first_loaded(tiers, states) or (DURABLE, None)
        self._took(loaded, tier, started)
        if self._lineage is not None and rank == 0 and cfg.enabled:  # the parents every checkpoint records
            self._writer.lineage = self._lineage(self._restored.path)
        self._cycle.start()
        return self._restored

    def load(self, states: dict[str, Any], path: Path) -> None:
        """Load ``states`` from checkpoint ``path`` (fetched and checked first) on every rank, as a resume would."""
        self._took(self._loader.load(states, Path(path)), DURABLE, time.perf_counter())

    def _took(self, loaded: Loaded | None, tier: str, started: float) -> None:
        """Record what a restore loaded; a resumed run's name and training time."""
        if loaded is None:
            return
        self._restored = Restored(loaded.path, loaded.states, tier, time.perf_counter() - started)
        if loaded.continues_run:
            self._writer.resumed_from = loaded.path.name
        if loaded.training_seconds is not None:
            self._time.restart(loaded.training_seconds)
