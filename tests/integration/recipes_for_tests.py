"""Recipe subclasses used by end-to-end tests to inject faults."""

from __future__ import annotations

import os
import signal

from automodel_ckpt.recipes.llm_finetune import FinetuneRecipe


class SaveHooks:
    """The checkpointer's two saves as recipe methods a test overrides (``save_checkpoint(info)``,
    ``save_local_checkpoint(info)``): its step-end call reaches them through the checkpointer's ``save`` and
    ``save_local``, wrapped once the checkpointer is built."""

    def setup(self):
        super().setup()
        self._saves = self.checkpointer.save, self.checkpointer._save_local
        self.checkpointer.save = lambda states, info: self.save_checkpoint(info)
        self.checkpointer._save_local = lambda states, info: self.save_local_checkpoint(info)

    def save_checkpoint(self, info):
        return self._saves[0](self.checkpointed_state(), info)

    def save_local_checkpoint(self, info):
        return self._saves[1](self.checkpointed_state(), info)


class CrashDuringSaveRecipe(SaveHooks, FinetuneRecipe):
    """SIGKILLs every rank in the middle of writing the checkpoint of step ``CRASH_AT_STEP``.

    The model shards are written, the optimizer state is not: the staged folder is left half-written.
    """

    def save_checkpoint(self, info):
        if info.step == int(os.environ.get("CRASH_AT_STEP", "-1")):
            from automodel_ckpt.ondisk.formats import sharded

            def die(*args, **kwargs):
                os.kill(os.getpid(), signal.SIGKILL)

            sharded.save_optimizer = die
        return super().save_checkpoint(info)


class HoldSnapshotRecipe(SaveHooks, FinetuneRecipe):
    """Holds the background copy of the state saved at step ``HOLD_AT_STEP`` (``checkpoint.is_async``) forever.

    Each rank touches ``$HOLD_MARKERS/capture<rank>`` when its copy is held, and ``fence<rank>`` when the next
    optimizer step (its forward and backward done meanwhile) waits at the fence for that copy.
    """

    def save_checkpoint(self, info):
        if info.step == int(os.environ.get("HOLD_AT_STEP", "-1")):
            import threading
            from pathlib import Path

            from automodel_ckpt.checkpoint.save import overlap
            from automodel_ckpt.ondisk.formats import sharded

            markers, rank = Path(os.environ["HOLD_MARKERS"]), self.env.rank
            fence = overlap.Overlapped.fence

            def hold(staged):
                (markers / f"capture{rank}").touch()
                threading.Event().wait()

            def fenced(job):
                (markers / f"fence{rank}").touch()
                fence(job)

            sharded.StagedSave.capture = hold
            overlap.Overlapped.fence = fenced
        return super().save_checkpoint(info)
