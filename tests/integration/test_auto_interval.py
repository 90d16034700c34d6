"""``step_scheduler.ckpt_every_steps: auto`` end to end (1 process, tiny model): killed and rerun after the interval
changed (from ``min_every_steps`` to the ``max_every_steps`` a huge MTBF clamps Young/Daly's interval to, whatever
the saves cost), the resume saves at the steps a straight run saves and its losses are bitwise the straight run's;
with a tiny MTBF, Young/Daly's interval is set from the measured save cost, said in one line and in events.jsonl,
and the run saves at it."""

from __future__ import annotations

import json
import subprocess

import pytest

from automodel_ckpt.ondisk import layout
from tests.integration import step_faults
from tests.integration.harness import (CKPT_TRAIN, QUIET, RECIPE, ckpt_train, env_for, kill_job, losses,
                                       run_command, start_command)

ARGS = ("--checkpoint.save_consolidated", "false", "--step_scheduler.ckpt_every_steps", "auto",
        "--step_scheduler.max_steps", "8", "--data.val_size", "64", "--step_scheduler.val_every_steps", "100",
        )
# at an MTBF of 10^6 hours Young/Daly asks for thousands of steps: clamped to 3, decided at the second save (step 4)
CLAMPED = ("--step_scheduler.min_every_steps", "2", "--step_scheduler.max_every_steps", "3",
           "--checkpoint.mtbf_hours", "1e6")


def _saved(run) -> list[int]:
    return sorted(int(p.name.rsplit("_", 1)[1]) for p in run.glob("epoch_*_step_*"))


def _events(run, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (run / layout.EVENTS_LOG).read_text().splitlines()) if r["event"] == kind]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, assets):
    work = tmp_path_factory.mktemp("auto_straight")
    ckpt_train(work, assets, *ARGS, *CLAMPED, "--checkpoint.checkpoint_dir", "run")
    return work / "run"


def test_killed_and_rerun_saves_at_the_straight_run_s_steps_bitwise(tmp_path, assets, straight):
    assert _saved(straight) == [2, 4, 7, 8]
    (change,) = _events(straight, "interval")
    assert (change["step"], change["every_steps"], change["next_step"]) == (4, 3, 7)
    cmd = [CKPT_TRAIN, "--nproc-per-node", "1", str(RECIPE), *QUIET, *ARGS, *CLAMPED, "--checkpoint.checkpoint_dir",
           "run", "--recipe", step_faults.RECIPE]
    pid_file = tmp_path / "stopped.pid"  # held after step 5: the step-4 checkpoint (every 3 from here) is published
    with open(tmp_path / "killed.log", "w") as log:
        job = start_command(cmd, cwd=tmp_path, env=env_for(assets, step_faults.env(5, pid_file)), stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        held = step_faults.stopped(pid_file, job)
    finally:
        kill_job(job)
    assert held is not None, (tmp_path / "killed.log").read_text()[-3000:]
    assert _saved(tmp_path / "run") == [2, 4]
    ckpt_train(tmp_path, assets, *ARGS, *CLAMPED, "--checkpoint.checkpoint_dir", "run")
    assert _saved(tmp_path / "run") == _saved(straight)
    assert losses(tmp_path / "run") == losses(straight)
    meta = json.loads((tmp_path / "run" / "epoch_0_step_7" / layout.METADATA_FILE).read_text())
    assert meta["step"] == 7
    assert len(_events(tmp_path / "run", "interval")) == 1  # the rerun went on with the interval decided at step 4


def test_a_tiny_mtbf_makes_young_daly_save_every_few_steps(tmp_path, assets):
    done = ckpt_train(tmp_path, assets, *ARGS, "--step_scheduler.max_steps", "14", "--step_scheduler.min_every_steps",
                      "1", "--step_scheduler.max_every_steps", "50", "--checkpoint.mtbf_hours", "1e-4",
                      "--checkpoint.checkpoint_dir", "run")
    run = tmp_path / "run"
    changes = _events(run, "interval")
    lines = [line for line in done.output.splitlines() if line.startswith("Checkpoint interval: ")]
    print(lines, _saved(run))
    saved = _saved(run)
    assert saved[0] == 1  # the first save measures the cost
    cost = run_command([CKPT_TRAIN, "inspect", str(run), "--cost"], cwd=tmp_path, env=env_for(assets), timeout=300)
    assert cost.returncode == 0 and f"ckpt_every_steps auto:      {len(changes)} change(s)" in cost.stdout, cost
    if not changes:  # Young/Daly asked for 1 step, the interval it started with: every step saves
        assert saved == list(range(1, 15))
        return
    assert len(lines) == len(changes) and lines[0] == changes[0]["text"]
    assert f"at the interval it replaced: every {changes[0]['was_every_steps']} steps, expected overhead" in cost.stdout
    assert changes[0]["mtbf_source"] == "given" and changes[0]["mtbf_s"] == pytest.approx(0.36)
    assert "Young/Daly's interval for" in lines[0] and "MTBF" in lines[0]
    for change, following in zip(changes, changes[1:] + [None]):  # between changes, saves come at the interval
        every, start = change["every_steps"], change["next_step"]
        end = following["step"] if following else 14
        expected = [s for s in range(start, end + 1, every)]
        assert [s for s in saved if start <= s <= end and s != 14] == [s for s in expected if s != 14], (change, saved)


def test_a_resume_whose_next_save_is_2_62_saves_at_its_interval_and_says_so(tmp_path, assets, straight):
    """The straight run's step-4 checkpoint, its schedule's next save rewritten to step 2**62 and the checkpoint
    resealed (as anyone who rewrites a checkpoint can): trusted, the resumed run would save only at its end,
    silently; it saves at step 7 (every 3 from step 4) and says so in one line."""
    import os
    import shutil

    import torch

    from automodel_ckpt.ondisk import manifest

    run = tmp_path / "run"
    shutil.copytree(straight, run, symlinks=True)
    for step in (7, 8):
        shutil.rmtree(run / f"epoch_0_step_{step}")
    for pointer in layout.POINTERS:
        for name in (pointer, f"{pointer}.txt"):
            if os.path.lexists(run / name):
                os.unlink(run / name)
    checkpoint = run / "epoch_0_step_4"
    state_file = checkpoint / layout.global_state_file("step_scheduler")
    state = torch.load(state_file, weights_only=True)
    assert state["save_interval"]["next_step"] == 7
    state["save_interval"]["next_step"] = 2**62
    torch.save(state, state_file)
    manifest.seal(checkpoint, 0, 1)
    done = ckpt_train(tmp_path, assets, *ARGS, *CLAMPED, "--checkpoint.checkpoint_dir", "run",
                      "--checkpoint.restore_from", "epoch_0_step_4")
    assert _saved(run) == [2, 4, 7, 8]
    said = [line for line in done.output.splitlines() if "the checkpoint's schedule was out of range" in line]
    assert said == ["warning: Checkpoint interval: the checkpoint's schedule was out of range: 'next_step' is "
                    "4611686018427387904, outside steps 5 to 7: saves every 3 steps, the next at step 7"], done.output
    assert "Traceback" not in done.output

