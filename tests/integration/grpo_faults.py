"""A GRPO recipe whose rank 0 stops itself (SIGSTOP) after a given step (``step_faults``' hook) or mid-generation."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from automodel_ckpt.algorithms.grpo.algorithm import GRPO
from tests.integration.step_faults import StopAfterStepRecipe

RECIPE = "tests.integration.grpo_faults.StopAfterStepGRPORecipe"


class StopInRolloutGRPO(GRPO):
    """``GRPO`` whose rank 0 stops while sampling rollout batch ``STOP_IN_ROLLOUT``: as the second forward of its
    generation begins (the first new token of every completion drawn, the rest not), after writing its pid to
    ``STOP_PID_FILE`` (``step_faults``' protocol: once the file exists no process stops again)."""

    def _sample(self, step, rows):
        stop, pid_file = os.environ.get("STOP_IN_ROLLOUT"), os.environ.get("STOP_PID_FILE")
        if not (stop and pid_file and self.ctx.env.is_main and step == int(stop) and not os.path.exists(pid_file)):
            return super()._sample(step, rows)
        forwards = []

        def hold(module, args, kwargs):
            forwards.append(1)
            if len(forwards) == 2:
                Path(pid_file + ".tmp").write_text(str(os.getpid()))
                os.rename(pid_file + ".tmp", pid_file)
                os.kill(os.getpid(), signal.SIGSTOP)

        handle = self.ctx.model.register_forward_pre_hook(hold, with_kwargs=True)
        try:
            return super()._sample(step, rows)
        finally:
            handle.remove()


    def _engine_sample(self, step, rows):
        """With ``grpo.engine vllm``: rank 0 stops as it is about to ask the engine for rollout batch
        ``STOP_IN_ROLLOUT`` (the prompts taken, the weights pushed and checked, nothing sampled), or kills its
        engine then (SIGKILL) at the rollout batches ``KILL_ENGINE_IN_ROLLOUT`` lists ("3,4,4": at batch 3 once, at
        batch 4 twice: its restarted engine too)."""
        self._kill_engine("KILL_ENGINE_IN_ROLLOUT", step)
        stop, pid_file = os.environ.get("STOP_IN_ROLLOUT"), os.environ.get("STOP_PID_FILE")
        if stop and pid_file and self.ctx.env.is_main and step == int(stop) and not os.path.exists(pid_file):
            Path(pid_file + ".tmp").write_text(str(os.getpid()))
            os.rename(pid_file + ".tmp", pid_file)
            os.kill(os.getpid(), signal.SIGSTOP)
        return super()._engine_sample(step, rows)

    def _asked(self, step, rows, prompts):
        """With ``grpo.max_staleness``: rank 0 kills its engine (SIGKILL) as it asks for rollout batch ``step`` ahead,
        at the batches ``KILL_ENGINE_AHEAD`` lists ("5,5": at batch 5 twice, its restarted engine too)."""
        self._kill_engine("KILL_ENGINE_AHEAD", step)
        return super()._asked(step, rows, prompts)

    def _kill_engine(self, variable: str, step: int) -> None:
        """Rank 0 kills its engine (SIGKILL) at rollout batch ``step`` as often as ``variable``'s list names it."""
        kills = [int(s) for s in os.environ.get(variable, "").split(",") if s]
        done = self.__dict__.setdefault("_kills", {}).setdefault(variable, [])
        if self.ctx.env.is_main and done.count(step) < kills.count(step):
            done.append(step)
            self.engine.proc.kill()
            self.engine.proc.wait()


class StopAfterStepGRPORecipe(StopAfterStepRecipe):
    """``GRPORecipe`` whose rank 0 stops after step ``STOP_AFTER_STEP`` (``tests/integration/step_faults.py``) or
    mid-generation of rollout batch ``STOP_IN_ROLLOUT``."""

    algorithm_class = StopInRolloutGRPO


def env(rollout: int, pid_file: Path) -> dict[str, str]:
    """The environment that makes a launch of ``RECIPE`` stop mid-generation of rollout batch ``rollout``."""
    return {"STOP_IN_ROLLOUT": str(rollout), "STOP_PID_FILE": str(pid_file),
            "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
