"""A recipe whose rank 0 stops itself (SIGSTOP) in the middle of a prune, for a test to look at the disk and SIGKILL it.

``STOP_IN_PRUNE`` names a file: the first process of the run to remove a hidden ``.deleting-*`` checkpoint folder
(``lifecycle.prune`` renames the checkpoint first, then removes it) writes its pid there once it has removed
``REMOVED_BEFORE_STOP`` of its files, and stops. Once the file exists no process stops again (the job's restarted
workers, a later launch). Python's audit events (``shutil.rmtree``, then an ``os.remove`` per file) say where the
process is: nothing of the product is changed or replaced.
"""

from __future__ import annotations

import os
import signal
import sys

from automodel_ckpt.recipes.vlm_finetune import VLMFinetuneRecipe

REMOVED_BEFORE_STOP = 3


class _StopInPrune:
    def __init__(self, pid_file: str) -> None:
        self.pid_file, self.removed = pid_file, None

    def __call__(self, event: str, args: tuple) -> None:
        if event == "shutil.rmtree":
            name = os.path.basename(os.fsdecode(args[0]))
            if name.startswith(".deleting-") and not os.path.exists(self.pid_file):
                self.removed = 0  # inside a prune's removal from now on
        elif event == "os.remove" and self.removed is not None:
            self.removed += 1
            if self.removed == REMOVED_BEFORE_STOP:
                self.removed = None
                with open(self.pid_file, "w") as out:
                    out.write(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGSTOP)


class StopInPruneVLMRecipe(VLMFinetuneRecipe):
    """``VLMFinetuneRecipe`` that stops in its first prune (``STOP_IN_PRUNE``: the file for its pid)."""

    def setup(self) -> None:
        pid_file = os.environ.get("STOP_IN_PRUNE")
        if pid_file:
            sys.addaudithook(_StopInPrune(pid_file))
        super().setup()
