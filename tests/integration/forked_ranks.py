"""``python -m torch.distributed.run --standalone --nproc-per-node N SCRIPT ARGS``, the ranks forked from one process.

    python -m tests.integration.forked_ranks N SCRIPT [ARGS ...]

torch's elastic agent as ``torchrun`` runs it (a rendezvous of its own, each rank's ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` ..., a failed rank stopping the others), but with ``start_method="fork"``: this process imports torch,
transformers and the package's modeling first (``launch.preload``), and each rank starts from those imports instead of
paying them again in a new interpreter (seconds of CPU a rank). Each rank runs SCRIPT as ``__main__`` with ARGS; a
rank that fails prints its traceback, and the command exits non-zero as ``torchrun`` does. A rank still running
after ``FORKED_RANKS_STACKS_AFTER`` seconds (default 240: every script here takes well under a minute) prints every
thread's stack and exits, so a hang fails its test with the place it hung instead of waiting for the test's timeout.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import runpy
import subprocess
import sys
import traceback
import uuid
import warnings
from pathlib import Path


PRELOAD_ENV = "FORKED_RANKS_PRELOAD"  # modules to import before the fork, comma-separated


def _rank(script: str, args: list[str]) -> None:
    from automodel_ckpt.distributed.env import return_on_success

    return_on_success()  # the script's ``end_process(0)`` returns here, for the agent to see the rank succeed
    faulthandler.dump_traceback_later(float(os.environ.get("FORKED_RANKS_STACKS_AFTER", "240")), exit=True)
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


def launch(nproc: int, script: Path, *args: str, env: dict[str, str],
           preload: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run ``script`` on ``nproc`` forked ranks from the test process; a launch that failed without an
    ``AssertionError`` (a rendezvous port taken, a rank that hung and printed its stacks) is launched once more, and
    a second failure reports both. ``preload``: modules every rank imports (DeepSpeed), imported once before the
    fork."""
    repo = str(Path(__file__).resolve().parents[2])
    env = {**env, "PYTHONPATH": repo, "PYTHONWARNINGS": "ignore", PRELOAD_ENV: ",".join(preload)}

    def once() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "tests.integration.forked_ranks", str(nproc), str(script),
                               *args], capture_output=True, text=True, timeout=600, env=env)

    done = once()
    if done.returncode != 0 and "AssertionError" not in done.stderr:
        first = done.stderr[-3000:]
        done = once()
        if done.returncode != 0:
            done.stderr = f"first launch:\n{first}\nsecond launch:\n{done.stderr}"
        else:  # the test passes; the first launch's end (a hung rank's stacks) goes to the run's warnings summary
            warnings.warn(f"{Path(script).name}: the first launch failed and the second passed; the first's end:\n"
                          f"{first}", RuntimeWarning, stacklevel=2)
    return done


def main(argv: list[str]) -> None:
    nproc, script, args = int(argv[0]), argv[1], argv[2:]
    gc.set_threshold(10_000, 10, 10)  # as ``ckpt-train`` starts: the imports scanned less often
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from automodel_ckpt.launch import preload

    preload("automodel_ckpt.recipes.llm_finetune.FinetuneRecipeForNextTokenPrediction",
            tuple(name for name in os.environ.get(PRELOAD_ENV, "").split(",") if name))
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, start_method="fork",
                          monitor_interval=0.1)
    sys.stdout.flush()
    sys.stderr.flush()
    gc.freeze()  # as ``launch._run_forking``: the imports out of the ranks' collections
    elastic_launch(config, entrypoint=_rank)(script, args)


if __name__ == "__main__":
    main(sys.argv[1:])
