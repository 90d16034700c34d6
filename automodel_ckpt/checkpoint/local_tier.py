"""The node-local tier (``checkpoint.local``): a step every few steps into node-local folders, and recovery from it.

A local step is a checkpoint like a durable one, written in the background by a second ``SaveWriter`` into a
``storage.nodelocal`` run folder (docs/fast-recovery.md).
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any, Callable

from automodel_ckpt.distributed import collective
from automodel_ckpt.checkpoint.config import AUTO, CheckpointConfig
from automodel_ckpt.ondisk import layout
from automodel_ckpt.ondisk.loadcheck import DamagedFile, deferred
from automodel_ckpt.ondisk.metadata import read_metadata
from automodel_ckpt.ondisk.info import HFArtifacts, SaveInfo
from automodel_ckpt.checkpoint.restore.fallback import AGAIN, LOCAL, NEXT
from automodel_ckpt.checkpoint.restore.loader import CheckpointLoader, Loaded
from automodel_ckpt.checkpoint.save import retry
from automodel_ckpt.checkpoint.save.diskfull import state_bytes
from automodel_ckpt.checkpoint.save.phases import TrainingTime
from automodel_ckpt.checkpoint.save.settings import WriteSettings
from automodel_ckpt.checkpoint.save.writer import SaveWriter
from automodel_ckpt.checkpoint.state import plan_state
from automodel_ckpt.checkpoint.storage import monitor_of
from automodel_ckpt.checkpoint.storage.nodelocal import localdir, recover
from automodel_ckpt.checkpoint.storage.nodelocal.folder import NodeLocalRunFolder
from automodel_ckpt.checkpoint.storage.nodelocal.placement import place
from automodel_ckpt.checkpoint.triggers import AutoInterval
from automodel_ckpt.distributed.env import DistEnv, all_gather_object, broadcast_object
from automodel_ckpt.distributed.mesh import ParallelDims
from automodel_ckpt.errors import CheckpointError, first_line


class LocalTier:
    """The node-local tier of one run; inert when ``every_steps`` is 0; with ``auto``, timed by an ``AutoInterval``."""

    def __init__(self, cfg: CheckpointConfig, env: DistEnv, dims: ParallelDims, *, config_yaml: str, hf: HFArtifacts,
                 fingerprint: dict[str, Any] | None, time: TrainingTime, say: Callable[[str], None],
                 interval: AutoInterval | None = None) -> None:
        self.settings = cfg.local
        self.env, self.say = env, say
        self.active = bool(cfg.enabled and self.settings.every_steps)
        # every_steps auto: Young/Daly's interval from the measured cost of a local step (its ``schedule``)
        self.interval = interval if self.settings.every_steps == AUTO else None
        if self.settings.every_steps == AUTO and (interval is None or interval.schedule is None):
            raise CheckpointError("checkpoint.local.every_steps: auto needs the run's node-local schedule (a recipe "
                                  "built by BaseRecipe.build_checkpointer gives it)")
        self._space_checked = False
        self.steps_abandoned = 0  # local steps abandoned by this launch
        self._faults: list[str] = []  # lines said since the last ``faults()``
        self._backoff = retry.Backoff()
        self._in_flight: str | None = None  # the local step being written in the background
        self._need: int | None = None  # a step's bytes in this node's folder (known from the first step on)
        if not self.active:
            return
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", env.world_size) or env.world_size)
        placement = place(env.rank, env.world_size, per_node, self.settings.replicas)
        if placement.warning and env.is_main:
            say(f"warning: {placement.warning}")
        run = broadcast_object(localdir.run_id(cfg.checkpoint_dir))  # rank 0's: every node names the run alike
        folder = Path(self.settings.dir).expanduser() if self.settings.dir else localdir.folder_of(run)
        self.run = NodeLocalRunFolder(folder, placement, run_id=run,
                                      fingerprint=fingerprint, monitor=monitor_of(cfg),
                                      default_folder=not self.settings.dir, say=say)
        self.writer = SaveWriter(WriteSettings.for_node_local(cfg), env, dims, self.run, config_yaml=config_yaml, hf=hf,
                                 fingerprint=fingerprint, time=time, say=_quiet, settle_full_disk=False)
        # every file a local step loads is checked as it is read: a node's own disk is not a durable store
        self.loader = CheckpointLoader(dataclasses.replace(cfg, verify_on_load=True), env, dims, self.run, say)
        self.run.acquire()

    def due(self, step: int) -> bool:
        """Whether a local step is taken after optimizer step ``step``."""
        if self.interval is not None:
            return self.active and self.interval.schedule.due(step)
        return self.active and step % self.settings.every_steps == 0

    def tick(self, steps: Any = None) -> None:
        """An optimizer step ended (``every_steps: auto``: the step time)."""
        if self.interval is not None:
            self.interval.tick(steps)

    def timed(self, steps: Any, take: Callable[[dict[str, Any], SaveInfo], Any], states: Callable[[], dict[str, Any]],
              info: SaveInfo) -> None:
        """``take(states(), info)``; with ``auto`` the interval decided first and the step timed (collective)."""
        if self.interval is None:
            take(states(), info)
            return
        self.interval.schedule.scheduled(steps.step)
        self.interval.decide(steps)
        started = time.perf_counter()
        take(states(), info)
        self.interval.measured(steps, time.perf_counter() - started)

    def save(self, states: dict[str, Any], info: SaveInfo) -> Path | None:
        """Snapshot ``states``; write, copy and commit in the background. None when off, skipped or abandoned."""
        if not self.active:
            return None
        self._settle()  # the step before: committed everywhere, or abandoned everywhere
        if not self._backoff.attempt():
            return None
        name = layout.checkpoint_name(info.epoch, info.step)
        path, error = None, None
        try:
            for folder in self.run.remake():
                self._report(f"warning: the node-local folder '{folder}' was removed; made again")
            if not self._space_checked:
                self._check_space(states)
            path = self.writer.write_checkpoint(plan_state(states), info)
        except Exception as exc:  # noqa: BLE001 - every step above is collective: every rank is here
            error = exc
        if self._failed(error, name):
            return None
        self._in_flight = path.name if path is not None else None
        return path

    def _check_space(self, states: dict[str, Any]) -> None:
        """Collective, before the first local step: each folder has room for ``keep + 1`` steps and the copies."""
        sizes = all_gather_object(state_bytes(states.values(), local=True))  # this rank's shards
        node = self.run.placement.node_of()
        mine = sum(b for r, b in enumerate(sizes) if self.run.placement.node_of(r) == node)
        self._need = mine * (1 + self.run.placement.copies)  # a step's bytes in this node's folder
        collective.collectively(
            lambda: localdir.check_space(self.run.local, mine, self.settings.keep, self.run.placement.copies)
            if self.run.leads else None, "checking the node-local folder's room", self.env.rank)
        self._space_checked = True

    def _settle(self) -> None:
        """Collective: the local step in flight completed; committed everywhere, or abandoned everywhere."""
        name, self._in_flight = self._in_flight, None
        error = None
        try:
            self.writer.wait()
        except Exception as exc:  # noqa: BLE001 - the completion is collective: every rank has the same outcome
            error = exc
        if name is None and error is None:
            return
        if not self._failed(error, name or "in flight"):
            ended = self._backoff.succeeded()
            if ended:
                self._report(f"node-local steps are written again: {name} (after {ended} failed in a row)")

    def _failed(self, error: BaseException | None, name: str) -> bool:
        """Collective: whether step ``name`` failed on any rank; then it is abandoned on every node, one warning says
        why, and the next tries are spaced out (``retry.Backoff``)."""
        outcomes = all_gather_object(retry.Outcome.of(error, self.run.local if self.run.leads else None, self._need))
        cause = retry.verdict(outcomes)
        if cause is None:
            return False
        leftovers = self.run.discard(name)
        self.steps_abandoned += 1
        skipped = self._backoff.failed()
        then = ("the next due node-local step is tried" if not skipped else "the next due node-local step is "
                "skipped" if skipped == 1 else f"the next {skipped} due node-local steps are skipped")
        left = f"; not removed: {'; '.join(leftovers[:2])}" if leftovers else ""
        self._report(f"warning: node-local step {name} abandoned: {cause}; training goes on, durable checkpoints "
                     f"are unaffected; {then}{left}")
        return True

    def _report(self, line: str) -> None:
        """A line for the console and for ``faults`` (rank 0)."""
        if self.env.is_main:
            self.say(line)
            self._faults.append(line)

    def faults(self) -> list[str]:
        """The lines said about local steps abandoned or written again since the last call (rank 0)."""
        lines, self._faults = self._faults, []
        return lines

    def fence(self) -> None:
        if self.active:
            self.writer.fence()

    def wait(self) -> None:
        """Collective: the local step in flight completed or, where it failed, abandoned (never raised)."""
        if self.active:
            self._settle()

    def finalize(self, *, done: bool) -> None:
        """End of training: the local step in flight settled; a finished run removes its local steps."""
        if not self.active:
            return
        try:
            if done:
                self._settle()
        finally:
            self.writer.close()
            try:
                self.run.release(keep_lock=not done)
            except (OSError, CheckpointError) as exc:  # unwritable: what it holds stays; the run is done all the same
                self.say(f"warning: cannot remove the node-local folder '{self.run.local}': {first_line(exc)}")

    def abandon(self, seconds: float) -> None:
        if self.active:
            self.writer.abandon(seconds)

    def recovery(self, durable: Path | None) -> LocalRecovery:
        """This tier first in a restore's fall-back loop: its newest local step newer than ``durable``'s newest."""
        return LocalRecovery(self, durable)


class LocalRecovery:
    """The node-local tier in a restore's loop: the newest local step complete somewhere, made whole everywhere and
    checked as it loads; a damaged file makes every file checked before choosing again, and a second failure (or
    any other) hands over to the durable tier."""

    name = LOCAL

    def __init__(self, tier: LocalTier, durable: Path | None) -> None:
        self.tier, self.durable, self.started = tier, durable, time.perf_counter()
        self._newest_durable = _step_of(durable)
        self._checked_whole = False  # after a damaged load: every file of every local step checked by the scan

    def choose(self, damage: str | None) -> Path | None:
        """This node's whole copy of the step chosen; None when none is newer or it could not be made whole."""
        tier = self.tier
        skipped: list[str] = []
        chosen, inventories = recover.newest_step(tier.run, skipped, leave=None if self._checked_whole else deferred)
        if tier.env.is_main:
            for line in skipped:
                tier.say(f"warning: {line}; not resuming from it")
        if chosen is None or (self._newest_durable is not None and chosen.step <= self._newest_durable):
            return None
        try:
            return recover.make_whole(tier.run, chosen, inventories)
        except CheckpointError as exc:
            self._hand_over(chosen.name, exc)
            return None

    def load(self, states: dict[str, Any], step: Path) -> Loaded:
        tier = self.tier
        # checked: every small file was hashed by the scan or on arrival; the large ones are as they load
        loaded = tier.loader.load(states, step, checked=True)
        if tier.env.is_main:
            than = f" (newer than the durable tier's {self.durable.name})" if self.durable is not None else ""
            tier.say(f"Resumed from the node-local tier: {step.name}{than}, loaded in "
                     f"{time.perf_counter() - self.started:.1f} s")
        return loaded

    def failed(self, step: Path, exc: CheckpointError) -> str:
        if isinstance(exc, DamagedFile) and not self._checked_whole:
            if self.tier.env.is_main:
                self.tier.say(f"warning: the node-local step {step.name} is damaged ({first_line(exc)}); checking "
                              "every file of the node-local steps before choosing again")
            self._checked_whole = True
            return AGAIN
        self._hand_over(step.name, exc)
        return NEXT

    def _hand_over(self, name: str, exc: CheckpointError) -> None:
        """Step ``name`` cannot be loaded (alike on every rank): say so and leave it to the durable tier."""
        if self.durable is None:
            raise CheckpointError(f"the node-local step {name} failed to load ({first_line(exc)}) "
                                  "and the durable tier holds no checkpoint to resume from instead") from None
        if self.tier.env.is_main:
            self.tier.say(f"warning: the node-local step {name} failed to load ({first_line(exc)}); "
                          f"resuming from the durable tier's {self.durable.name}")


def _quiet(_: str) -> None:
    """Local steps are not announced one by one (the durable saves are)."""


def _step_of(path: Path | None) -> int | None:
    if path is None:
        return None
    step = (read_metadata(path) or {}).get("step")
    return int(step) if isinstance(step, int) else None
