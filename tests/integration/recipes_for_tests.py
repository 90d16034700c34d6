"""Recipe subclasses used by end-to-end tests to inject faults."""

from __future__ import annotations

import os
import signal

from automodel_ckpt.recipes.llm_finetune import FinetuneRecipe


class CrashDuringSaveRecipe(FinetuneRecipe):
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


class HoldSnapshotRecipe(FinetuneRecipe):
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
