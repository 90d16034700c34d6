"""A checkpoint written by an earlier release, kept as a fixture, still verifies and resumes exactly.

``tests/fixtures/release_8af28e1`` holds a run folder that automodel-ckpt wrote at commit 8af28e1 (before the
checkpoint folder's bytes and the engine became two packages): its recipe (a ~10k-parameter Llama built from a
config, 2 processes, 4 steps, a checkpoint every 2), the tokenizer it read, the run folder with its checkpoint of
step 4, and what that release logged for steps 5 and 6 when it trained straight to step 6. The layout on disk is a
contract: the same command rerun with more steps resumes from that checkpoint with today's code, takes the same
samples, and computes the same losses.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.integration.harness import CKPT_TRAIN, env_for, jsonl, run_command

pytestmark = pytest.mark.integration

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "release_8af28e1"


def test_a_checkpoint_of_an_earlier_release_verifies_and_resumes_exactly(tmp_path, assets):
    work = tmp_path / "release"
    shutil.copytree(FIXTURE, work)
    env = env_for(assets)
    checked = run_command([CKPT_TRAIN, "verify", "run/epoch_0_step_4"], cwd=work, env=env, timeout=300)
    assert checked.returncode == 0, checked.stdout + checked.stderr

    done = run_command([CKPT_TRAIN, "--nproc-per-node", "2", "recipe.yaml", "--step_scheduler.max_steps", "6"],
                       cwd=work, env=env, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]

    starts = [e for e in jsonl(work / "run" / "events.jsonl") if e["event"] == "start"]
    assert starts[-1]["resumed_from"] == "epoch_0_step_4" and starts[-1]["tier"] == "durable"
    logged = {row["step"]: row for row in jsonl(work / "run" / "training.jsonl")}
    expected = json.loads((FIXTURE / "straight_steps_5_6.json").read_text())["steps"]
    for step in (5, 6):
        assert logged[step]["sample_ids"] == expected[str(step)]["sample_ids"], step
        # bitwise on the machine that wrote the fixture; other CPUs' kernels round the last bits differently
        assert logged[step]["loss"] == pytest.approx(expected[str(step)]["loss"], abs=1e-5), step
        assert logged[step]["grad_norm"] == pytest.approx(expected[str(step)]["grad_norm"], abs=1e-5), step
    assert (work / "run" / "epoch_0_step_6").is_dir()
