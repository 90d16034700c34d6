"""``python -m torch.distributed.run --standalone --nproc-per-node N SCRIPT ARGS``, the ranks forked from one process.

    python -m tests.integration.forked_ranks N SCRIPT [ARGS ...]

torch's elastic agent as ``torchrun`` runs it (a rendezvous of its own, each rank's ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` ..., a failed rank stopping the others), but with ``start_method="fork"``: this process imports torch,
transformers and the package's modeling first (``launch.preload``), and each rank starts from those imports instead of
paying them again in a new interpreter (seconds of CPU a rank). Each rank runs SCRIPT as ``__main__`` with ARGS; a
rank that fails prints its traceback, and the command exits non-zero as ``torchrun`` does.
"""

from __future__ import annotations

import runpy
import sys
import traceback
import uuid


def _rank(script: str, args: list[str]) -> None:
    from automodel_ckpt.distributed.env import return_on_success

    return_on_success()  # the script's ``end_process(0)`` returns here, for the agent to see the rank succeed
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if stop.code not in (None, 0):
            raise
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        raise


def main(argv: list[str]) -> None:
    nproc, script, args = int(argv[0]), argv[1], argv[2:]
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from automodel_ckpt.launch import preload

    preload("automodel_ckpt.recipes.llm_finetune.FinetuneRecipeForNextTokenPrediction")
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, start_method="fork",
                          monitor_interval=0.1)
    sys.stdout.flush()
    sys.stderr.flush()
    elastic_launch(config, entrypoint=_rank)(script, args)


if __name__ == "__main__":
    main(sys.argv[1:])
