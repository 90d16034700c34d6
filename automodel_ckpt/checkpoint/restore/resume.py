"""What a run resumes from: the newest checkpoint that loads, checked before any state changes; damaged ones quarantined.

Every rank checks the candidate together (``probe``) before anything is loaded; a failure anywhere quarantines it
on rank 0 and the next newest is tried, so a resume after a fallback is bitwise the resume from that older one. An
explicit ``restore_from`` that fails, or any failure with ``on_load_error: error``, is an error. ``DurableTier`` is
this tier of ``fallback.first_loaded``; with ``load_only`` the run's own checkpoints come first.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from automodel_ckpt.distributed import collective
from automodel_ckpt.checkpoint.config import CheckpointConfig, LoadErrorPolicy
from automodel_ckpt.checkpoint.storage.base import RunStorage
from automodel_ckpt.checkpoint.restore.fallback import AGAIN, DURABLE
from automodel_ckpt.checkpoint.restore.probe import StageRule, check_same_run, probe
from automodel_ckpt.errors import CheckpointError, first_line, warn
from automodel_ckpt.ondisk.loadcheck import DamagedFile

if TYPE_CHECKING:
    from automodel_ckpt.checkpoint.restore.loader import CheckpointLoader, Loaded


@dataclass(frozen=True)
class Decision:
    """What a run resumes from: ``path`` None, a fresh run; else a checkpoint checked on every rank."""

    path: Path | None = None
    fallback: bool = False  # found damaged while loading: set it aside and decide again (an automatic resume)

    @property
    def fresh(self) -> bool:
        return self.path is None


class DurableTier:
    """The durable tier in the restore's loop: ``decide`` chooses (a fresh start too), the loader loads, and a
    checkpoint found damaged while loading is set aside and the choice made again."""

    name = DURABLE

    def __init__(self, cfg: CheckpointConfig, source: RunStorage, loader: CheckpointLoader, *, rank: int,
                 world_size: int, fingerprint: dict[str, Any] | None, say: Callable[[str], None],
                 stages: StageRule | None = None) -> None:
        self.cfg, self.source, self.loader = cfg, source, loader
        self.rank, self.world_size, self.fingerprint, self.say = rank, world_size, fingerprint, say
        self.stages = stages

    def choose(self, damage: str | None) -> Decision | None:
        return decide(self.cfg, self.source, rank=self.rank, world_size=self.world_size,
                      fingerprint=self.fingerprint, say=self.say, damaged_while_loading=damage, stages=self.stages)

    def load(self, states: dict[str, Any], decision: Decision) -> Loaded | None:
        if decision.path is None:  # a fresh run
            return None
        return self.loader.load(states, decision.path, checked=True)

    def failed(self, decision: Decision, exc: CheckpointError) -> str | None:
        if not isinstance(exc, DamagedFile) or not decision.fallback or decision.path is None:
            return None
        set_aside(self.source, decision.path, exc, rank=self.rank, say=self.say)
        return AGAIN


def decide(cfg: CheckpointConfig, source: RunStorage, *, rank: int, world_size: int,
           fingerprint: dict[str, Any] | None, say: Callable[[str], None],
           damaged_while_loading: str | None = None, stages: StageRule | None = None) -> Decision | None:
    """Collective: select and check the checkpoint this run resumes; None with ``load_only`` and none of its own.
    ``damaged_while_loading``: the damage that set the last decision aside mid-load, in one line (some state holds
    its bytes, so a fresh start is no longer an option). ``stages``: a run in stages' fingerprint rule."""
    if damaged_while_loading is None:
        if not cfg.enabled and cfg.restore_from is None:
            return Decision()
        auto = cfg.restore_from is None
        if cfg.load_only:
            # The run's own checkpoints come first: a rerun of a run that started from other weights resumes itself.
            if not (cfg.enabled and source.has_checkpoints()):
                return None  # nothing of its own: the weights-only start starts it
            auto = True
    else:
        auto = True  # only an automatic resume decides again
    fallback = auto and cfg.on_load_error != LoadErrorPolicy.ERROR
    while True:
        path = source.find(None if auto else cfg.restore_from)
        if path is None:
            if damaged_while_loading is not None:
                raise CheckpointError(f"{damaged_while_loading}; it was moved aside, and no older checkpoint is left to load over "
                                      "what was partly loaded from it: start the run again to begin afresh")
            return Decision()
        unfetched = _fetch(source, path)  # a checkpoint on an object store: its files into the local mirror first
        if unfetched is None:
            check_same_run(path, fingerprint, source.local, stages)  # every rank reads the same small file: same verdict
        try:
            if unfetched is not None:  # a missing or unreadable object: damaged like a missing file
                raise unfetched
            collective.collectively(
                lambda: probe(path, checksums=cfg.verify_on_load, rank=rank, world_size=world_size, warn=warn),
                f"checking '{path}'", rank)
        except CheckpointError as exc:
            if not fallback:
                raise
            set_aside(source, path, exc, rank=rank, say=say)
            continue
        return Decision(path, fallback=fallback)


def set_aside(source: RunStorage, path: Path, exc: CheckpointError, *, rank: int, say: Callable[[str], None]) -> None:
    """Collective: quarantine damaged checkpoint ``path`` and say so."""
    reason = first_line(exc)
    if reason.startswith(f"checking '{path}' failed on rank "):  # keep what is wrong, not the wrapper
        reason = reason.split(": ", 1)[-1]
    moved = collective.on_main(lambda: source.quarantine(path.name, reason), "moving the damaged checkpoint aside",
                               rank)
    if rank == 0:
        say(f"warning: checkpoint '{path.name}' cannot be loaded ({reason}); moved it to {moved} "
            "and resuming from the newest checkpoint before it")


def _fetch(source: RunStorage, path: Path) -> CheckpointError | None:
    try:
        source.fetch(path)
    except CheckpointError as exc:
        return exc
    return None
