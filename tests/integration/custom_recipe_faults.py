"""examples/custom_recipe.py's recipe with a fault at a chosen step: SIGKILL in the middle of a save, or the
preemption signal sent to itself."""

from __future__ import annotations

import os
import signal

from automodel_ckpt.checkpoint import Checkpointer
from examples.custom_recipe import LineFitRecipe


def _die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


class FaultyLineFitRecipe(LineFitRecipe):
    """``CRASH_AT_STEP``: SIGKILL once the model is written and before the optimizer is (a half-written save).
    ``PREEMPT_AT_STEP``: SIGTERM to itself as that step ends (the step-end call sees it at once)."""

    def run(self) -> None:
        crash, preempt = int(os.environ.get("CRASH_AT_STEP", "-1")), int(os.environ.get("PREEMPT_AT_STEP", "-1"))
        save, step_end = Checkpointer.save, Checkpointer.step_end

        def faulty_save(checkpointer, states, info):
            if info.step == crash:
                from automodel_ckpt.ondisk.formats import sharded

                sharded.save_optimizer = _die
            return save(checkpointer, states, info)

        def signalled_step_end(checkpointer, states, steps, **kwargs):
            if steps.step == preempt:
                os.kill(os.getpid(), signal.SIGTERM)
            return step_end(checkpointer, states, steps, **kwargs)

        Checkpointer.save, Checkpointer.step_end = faulty_save, signalled_step_end
        super().run()
