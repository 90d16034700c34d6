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
            from automodel_ckpt.checkpoint.formats import sharded

            def die(*args, **kwargs):
                os.kill(os.getpid(), signal.SIGKILL)

            sharded.save_optimizer = die
        return super().save_checkpoint(info)
