"""Recipe subclasses the node-local tier tests use to lose nodes and workers at chosen moments."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

from automodel_ckpt.recipes.dpo import DPORecipe
from automodel_ckpt.recipes.llm_finetune import FinetuneRecipe
from tests.integration.recipes_for_tests import SaveHooks


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _chosen(rank: int) -> bool:
    ranks = os.environ.get("DIE_RANKS", "all")
    return ranks == "all" or str(rank) in ranks.split(",")


def _first_time(marker: str) -> bool:
    """Whether this death has not happened yet in this run (``$DIE_MARKERS/<marker>`` records it): restarted
    workers, however many restarts it takes, die once."""
    folder = os.environ.get("DIE_MARKERS")
    if folder is None:
        return True
    path = Path(folder) / marker
    if path.exists():
        return False
    path.touch()
    return True


class DieAfterLocalStepRecipe(SaveHooks, FinetuneRecipe):
    """Every rank in ``DIE_RANKS`` (default: all) SIGKILLs itself once the node-local step of ``DIE_AFTER_LOCAL_STEP``
    is committed on every node (once per run with ``DIE_MARKERS``, after the death during a local step if one is
    asked for)."""

    def save_local_checkpoint(self, info):
        due = info.step == int(os.environ.get("DIE_AFTER_LOCAL_STEP", "-1")) and _chosen(self.env.rank)
        # that death comes first; asked before the step starts (its background thread records that death)
        first = bool(os.environ.get("DIE_DURING_LOCAL_STEP")) and not self._died_during()
        path = super().save_local_checkpoint(info)
        if due and not first and _first_time("after"):
            self.checkpointer._local.writer.wait()  # committed everywhere (the completion is collective)
            _die()
        return path

    def _died_during(self) -> bool:
        folder = os.environ.get("DIE_MARKERS")
        return folder is not None and (Path(folder) / "during").exists()


class DieDuringLocalStepRecipe(DieAfterLocalStepRecipe):
    """Ranks in ``DIE_RANKS`` SIGKILL themselves in the middle of the node-local step of ``DIE_DURING_LOCAL_STEP``
    (written, not yet copied to other nodes nor committed), once per run."""

    def save_local_checkpoint(self, info):
        dies = info.step == int(os.environ.get("DIE_DURING_LOCAL_STEP", "-1")) and _chosen(self.env.rank) \
            and not self._died_during()
        if dies:
            from automodel_ckpt.checkpoint.storage.nodelocal.folder import NodeLocalRunFolder

            def die_once(*args, **kwargs):
                _first_time("during")
                _die()

            NodeLocalRunFolder.upload = die_once
        path = super().save_local_checkpoint(info)
        if dies:  # die before training goes on (the background thread reaches the copy): never after a later save
            self.checkpointer._local.writer.wait()
        return path


def _fill(path: Path, leave: int = 0) -> None:
    """Write zeros to ``path`` until its filesystem has no room left (another job filling the node's tmpfs), then
    give ``leave`` bytes of it back."""
    with open(path, "wb", buffering=0) as f:
        for block in (bytes(1 << 20), bytes(4096)):
            try:
                while True:
                    f.write(block)
            except OSError:
                pass
        if leave:
            f.truncate(max(0, f.tell() - leave))


class LocalFolderFaultsRecipe(SaveHooks, FinetuneRecipe):
    """The node-local folder of the ranks in ``FAULT_RANKS`` (default: all) fails just before the local step of
    ``FAULT_AT_LOCAL_STEP`` and is mended just before the one of ``MEND_AT_LOCAL_STEP`` (the local step before
    settled first, on every rank, so that no write races the fault). ``FAULT``: ``fill`` (the file ``$FILLER``,
    outside the folder, fills its filesystem but for ``$FILL_LEAVE_BYTES``; mended: removed), ``remove`` (the
    folder removed; nothing to mend) or ``readonly`` (the filesystem ``$MOUNT`` remounted read-only; mended: made
    writable again). With ``LOCAL_LISTING``, rank 0 appends the names in its node-local folder after each local
    step, one line ``step: name name ...``. With ``DIE_AFTER_LOCAL_STEP``, every rank SIGKILLs itself once the
    background work of that local step has ended (before the run learns whether it failed)."""

    def save_local_checkpoint(self, info):
        ranks = os.environ.get("FAULT_RANKS", "all")
        mine = ranks == "all" or str(self.env.rank) in ranks.split(",")
        fault = info.step == int(os.environ.get("FAULT_AT_LOCAL_STEP", "-1"))
        mend = info.step == int(os.environ.get("MEND_AT_LOCAL_STEP", "-1"))
        if fault or mend:
            self.checkpointer._local.wait()
        if mine and (fault or mend):
            getattr(self, f"_{'mend' if mend else 'fault'}_{os.environ['FAULT']}")()
        path = super().save_local_checkpoint(info)
        if info.step == int(os.environ.get("DIE_AFTER_LOCAL_STEP", "-1")):
            background = self.checkpointer._local.writer.background
            if background is not None and background.completed is not None:
                background.completed.exception()  # its completion ended, failed or not, on every rank
            _die()
        if os.environ.get("LOCAL_LISTING") and self.env.rank == 0:
            folder = Path(self.checkpoint_config.local.dir)
            names = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else ["(none)"]
            with open(os.environ["LOCAL_LISTING"], "a") as f:
                f.write(f"{info.step}: {' '.join(names)}\n")
        return path

    def _fault_fill(self):
        _fill(Path(os.environ["FILLER"]), int(os.environ.get("FILL_LEAVE_BYTES", "0")))

    def _mend_fill(self):
        Path(os.environ["FILLER"]).unlink()

    def _fault_remove(self):
        shutil.rmtree(self.checkpoint_config.local.dir)

    def _fault_readonly(self):
        subprocess.run(["mount", "-o", "remount,ro", os.environ["MOUNT"]], check=True)

    def _mend_readonly(self):
        subprocess.run(["mount", "-o", "remount,rw", os.environ["MOUNT"]], check=True)


class DieAfterLocalStepDPORecipe(DieAfterLocalStepRecipe, DPORecipe):
    """``DieAfterLocalStepRecipe`` for a preference run."""
