"""The save schedule: time-based saves with a fake clock, the preemption flag, node-local steps, their config
(docs/async.md)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from automodel_ckpt.checkpoint.config import CheckpointConfig, normalize_signal_name
from automodel_ckpt.errors import ConfigError
from automodel_ckpt.checkpoint.triggers import Boundary, PreemptionWatcher, SaveDecision, SaveSchedule, \
    StepBoundary, TimeTrigger
from automodel_ckpt.training.step_scheduler import StepScheduler

REPO = Path(__file__).resolve().parents[3]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def no_signal() -> PreemptionWatcher:
    return PreemptionWatcher(None, repeat_stops=True)


def test_timer_is_due_every_n_minutes_after_the_last_save():
    clock = FakeClock()
    boundary = StepBoundary(no_signal(), TimeTrigger(1.5, clock=clock))
    saved = []
    for step in range(1, 11):
        clock.now += 20.0  # a 20 s step
        if boundary.check().time_due:
            saved.append(step)
            boundary.saved()
    assert saved == [5, 10]  # 100 s >= 90 s; then 100 s after that save


def test_one_schedule_decides_every_kind_of_save():
    """Durable every 5 steps and at the end, every 1.5 minutes, node-local every 2 (never beside a durable save nor after
    the last step), a preemption: one decision per step."""
    clock = FakeClock()
    steps = StepScheduler(max_steps=10, num_epochs=1, ckpt_every_steps=5, val_every_steps=None, steps_per_epoch=100)
    watcher = no_signal()
    schedule = SaveSchedule(steps, StepBoundary(watcher, TimeTrigger(1.5, clock=clock)), enabled=True,
                            local_due=lambda step: step % 2 == 0)
    decided = {}
    for step in range(1, 11):
        steps.record_step(0, 8)
        clock.now += 1.0 if step != 6 else 200.0  # step 6 makes the minutes due
        if step == 9:
            watcher.received = 1  # a preemption seen before step 9's boundary
        decided[step] = due = schedule.decide()
        if due.durable:
            schedule.saved()
    assert [s for s, d in decided.items() if d.durable] == [5, 6, 9, 10]
    assert [s for s, d in decided.items() if d.local] == [2, 4, 8]
    assert decided[6] == SaveDecision(durable=True, scheduled=True)
    assert decided[9].preempt and decided[9].durable
    off = SaveSchedule(steps, StepBoundary(no_signal(), TimeTrigger(None)), enabled=False, local_due=lambda s: True)
    assert off.decide() == SaveDecision()  # saving disabled, after the last step: nothing


def test_timer_disabled_never_due_and_never_reduces():
    calls = []
    boundary = StepBoundary(no_signal(), TimeTrigger(None, clock=FakeClock()), reduce_max=calls.append)
    assert not boundary.enabled
    assert boundary.check() == Boundary()
    assert calls == []  # no collective at all when neither trigger is configured


def test_ranks_agree_when_their_clocks_disagree():
    """Two ranks whose timers disagree save the same step: the first timer due (the max over ranks) decides."""
    clock = FakeClock()
    timers = [TimeTrigger(1.0, clock=clock), TimeTrigger(1.0, clock=clock)]
    timers[1].last -= 15.0  # rank 1's timer started 15 s earlier
    watchers = [no_signal(), no_signal()]

    def reduce_for(rank: int):
        def reduce_max(values):  # the all-reduce: elementwise max with the other rank's values
            other = 1 - rank
            theirs = [int(watchers[other].requested), int(timers[other].due())]
            return [max(a, b) for a, b in zip(values, theirs)]
        return reduce_max

    boundaries = [StepBoundary(watchers[r], timers[r], reduce_max=reduce_for(r)) for r in (0, 1)]
    decided: dict[int, list[int]] = {0: [], 1: []}
    for step in range(1, 13):
        clock.now += 10.0  # a 10 s step
        results = [b.check() for b in boundaries]
        for r in (0, 1):
            if results[r].time_due:
                decided[r].append(step)
                boundaries[r].saved()
    # rank 1 is due at step 5 (65 s), rank 0 alone would have waited for step 6; after the save both restart
    assert decided[0] == decided[1] == [5, 11]


def test_preemption_flag_and_repeats(monkeypatch):
    watcher = PreemptionWatcher("SIGUSR1", repeat_stops=False)
    watcher.install()
    try:
        assert not watcher.requested
        os.kill(os.getpid(), signal.SIGUSR1)
        assert watcher.requested and watcher.name == "SIGUSR1"
        os.kill(os.getpid(), signal.SIGUSR1)  # a worker ignores repeats (the launcher may forward it again)
        assert watcher.received == 2
        boundary = StepBoundary(watcher, TimeTrigger(None))
        assert boundary.check() == Boundary(preempt=True, time_due=False)
    finally:
        watcher.uninstall()
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL


def test_signal_names_and_minutes_are_validated():
    assert normalize_signal_name("term") == "SIGTERM"
    assert normalize_signal_name("SIGUSR1") == "SIGUSR1"
    assert normalize_signal_name(None) is None and normalize_signal_name("null") is None
    with pytest.raises(ConfigError, match="not a signal name"):
        normalize_signal_name("SIGNOPE")
    with pytest.raises(ConfigError, match="cannot be caught"):
        normalize_signal_name("SIGKILL")
    with pytest.raises(ConfigError, match="ckpt_every_minutes: expected a positive number"):
        CheckpointConfig(ckpt_every_minutes=0)
    cfg = CheckpointConfig(preemption_signal="usr2", ckpt_every_minutes=0.5)
    assert cfg.preemption_signal == "SIGUSR2"


def test_recipe_saves_by_the_clock(tmp_path, monkeypatch):
    """The training loop saves when the (fake) clock says so, besides ckpt_every_steps and the final step."""
    from automodel_ckpt.config.loader import load_config
    from automodel_ckpt.config.schema import RecipeConfig
    from automodel_ckpt.config.validate import validate_config
    from automodel_ckpt.models.tiny import ensure_tiny_base
    from automodel_ckpt.checkpoint import cycle
    from automodel_ckpt.recipes import llm_finetune

    ensure_tiny_base(tmp_path / "assets" / "tiny_llama_base")
    monkeypatch.setenv("AUTOMODEL_CKPT_ASSETS", str(tmp_path / "assets"))
    clock = FakeClock()
    monkeypatch.setattr(cycle, "TimeTrigger", lambda minutes: TimeTrigger(minutes, clock=clock))
    run_dir = tmp_path / "run"
    cfg = load_config(str(REPO / "recipes" / "tiny_llama_sft.yaml"), [
        "--training.progress_bar", "false", "--step_scheduler.max_steps", "7", "--step_scheduler.ckpt_every_steps",
        "100", "--checkpoint.ckpt_every_minutes", "1", "--checkpoint.save_consolidated", "false",
        "--checkpoint.checkpoint_dir", str(run_dir), "--data.val_size", "16", "--dataset.num_samples", "256",
        "--step_scheduler.global_batch_size", "8", "--step_scheduler.local_batch_size", "8",
    ], RecipeConfig)
    validate_config(cfg, 1)

    class Recipe(llm_finetune.FinetuneRecipe):
        def train_step(self, micro):
            clock.now += 25.0  # every step takes 25 s on the fake clock
            return super().train_step(micro)

    Recipe(cfg).run()
    saved = sorted(int(p.name.rsplit("_", 1)[1]) for p in run_dir.glob("epoch_0_step_*"))
    assert saved == [3, 6, 7]  # 75 s >= 60 s at step 3, again at step 6, and the final step
