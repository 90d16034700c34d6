"""A fine-tune killed in the middle of an evaluation during training (``evaluation:``), for the end-to-end tests."""

from __future__ import annotations

import os
import signal

from automodel_ckpt.recipes.llm_finetune import FinetuneRecipe


class KillDuringEvalRecipe(FinetuneRecipe):
    """SIGKILLs rank 0 inside the evaluation of step ``KILL_AT_EVAL_STEP``: the weights gathered, the harness's
    model built, the tasks not scored yet (the launcher then ends the other ranks)."""

    def _evaluate_and_log(self):
        if self.step_scheduler.step == int(os.environ.get("KILL_AT_EVAL_STEP", "-1")):
            from automodel_ckpt.evaluation import harness

            def die(*args, **kwargs):
                os.kill(os.getpid(), signal.SIGKILL)

            harness.evaluate = die
        return super()._evaluate_and_log()
