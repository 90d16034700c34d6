"""``step_scheduler.ckpt_every_steps: auto``: the interval state (checkpointed with the step counters) and the save
cycle's Young/Daly decision from measured costs, the same on every rank, each change one line and one record."""

from __future__ import annotations

from automodel_ckpt.checkpoint import AutoInterval
from automodel_ckpt.training.step_scheduler import StepScheduler


def _steps(**kw) -> StepScheduler:
    return StepScheduler(max_steps=100, num_epochs=1, steps_per_epoch=100, ckpt_every_steps="auto", **kw)


def _saves(steps: StepScheduler, until: int, on_save=lambda s: None, tick=lambda: None) -> list[int]:
    out = []
    while steps.step < until:
        steps.record_step(0, 1)
        tick()
        if steps.is_ckpt_step:
            out.append(steps.step)
            steps.save_interval.scheduled(steps.step)
            on_save(steps)
    return out


def test_min_equal_to_max_saves_every_n_and_a_resume_saves_where_a_straight_run_does():
    straight = _saves(_steps(min_every_steps=3, max_every_steps=3), 20)
    assert straight == [3, 6, 9, 12, 15, 18]
    first = _steps(min_every_steps=3, max_every_steps=3)
    assert _saves(first, 7) == [3, 6]
    first.record_step(0, 1)  # step 7: a save of the minutes (not scheduled) does not move the schedule
    first.save_interval.scheduled(7)
    state = first.state_dict()
    again = _steps(min_every_steps=3, max_every_steps=3)
    again.load_state_dict(state)
    assert state["save_interval"] == {"every": 3, "next_step": 9}
    assert _saves(again, 20) == [9, 12, 15, 18]


def test_young_daly_from_the_measured_cost_and_every_rank_decides_the_same():
    said, notes, reduced = [], [], []

    def reduce_max(values):  # the other rank blocked longer: MAX wins
        reduced.append(list(values))
        return [max(values[0], 0.5), values[1], values[2]]

    auto = AutoInterval(lambda cost, mtbf, step: round((2 * cost * mtbf) ** 0.5 / step), mtbf_hours=8 / 3600,
                        observed_mtbf_s=lambda: None, is_main=True, say=said.append, note=notes.append,
                        reduce_max=reduce_max, clock=lambda: steps.step * 0.5)  # half a second a step
    steps = _steps(min_every_steps=2, max_every_steps=50)
    saves = _saves(steps, 30, lambda s: auto.measured(s, 0.1), auto.tick)
    # cost 0.5 s (MAX), mtbf 8 s: sqrt(2 * 0.5 * 8) = 2.83 s, at 0.5 s a step: 6 steps
    assert saves == [2, 8, 14, 20, 26] and len(notes) == 1
    assert notes[0]["event"] == "interval" and notes[0]["blocked_s"] == 0.5 and notes[0]["mtbf_source"] == "given"
    assert said[0].startswith(f"Checkpoint interval: every {notes[0]['every_steps']} steps (was 2): Young/Daly's")
    assert reduced[0][2] == 8.0  # the MTBF travels in the same all-reduce


def test_the_mtbf_is_the_run_s_observed_one_else_24_hours():
    notes = []
    auto = AutoInterval(lambda cost, mtbf, step: 7 if mtbf == 24 * 3600 else 5, mtbf_hours=None,
                        observed_mtbf_s=lambda: None, is_main=True, say=lambda line: None, note=notes.append,
                        reduce_max=lambda v: list(v), clock=iter(range(100)).__next__)
    steps = _steps(min_every_steps=1)
    _saves(steps, 3, lambda s: auto.measured(s, 0.01), auto.tick)
    assert notes[0]["every_steps"] == 7 and notes[0]["mtbf_source"] == "assumed"


def test_the_keys_are_checked_in_one_line(capsys):
    from pathlib import Path

    from automodel_ckpt.cli import main

    recipe = str(Path(__file__).resolve().parents[3] / "recipes" / "tiny_llama_sft.yaml")
    for args, expected in ((["--step_scheduler.ckpt_every_steps", "often"], "expected a positive integer or auto"),
                           (["--step_scheduler.ckpt_every_steps", "auto", "--step_scheduler.min_every_steps", "5",
                             "--step_scheduler.max_every_steps", "2"], "max_every_steps: 2 is below min_every_steps"),
                           (["--checkpoint.mtbf_hours", "0"], "checkpoint.mtbf_hours: expected a positive number")):
        assert main([recipe, "--dry-run", *args]) != 0
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and expected in err, err
    assert main([recipe, "--dry-run", "--step_scheduler.ckpt_every_steps", "auto"]) == 0
    assert "ckpt_every_steps: auto" in capsys.readouterr().out


def test_the_cost_report_sets_the_auto_interval_beside_the_fixed_one_it_replaced():
    from automodel_ckpt.tracking import cost_report, render_cost, summarize

    events = [{"event": "start", "time": 0.0, "step": 0, "every_steps": 10},
              {"event": "checkpoint", "time": 5.0, "step": 10, "blocked_s": 0.5},
              {"event": "end", "time": 6.0, "step": 10, "status": "complete", "wall_s": 6.0, "blocked_s": 0.5},
              {"event": "start", "time": 7.0, "step": 10, "every_steps": "auto"},
              {"event": "checkpoint", "time": 8.0, "step": 11, "blocked_s": 0.5},
              {"event": "interval", "time": 8.0, "step": 11, "every_steps": 4, "was_every_steps": 1},
              {"event": "checkpoint", "time": 9.0, "step": 15, "blocked_s": 0.5},
              {"event": "checkpoint", "time": 10.0, "step": 19, "blocked_s": 0.5},
              {"event": "end", "time": 11.0, "step": 19, "status": "complete", "wall_s": 4.0, "blocked_s": 1.5}]
    report = cost_report(summarize(events), mtbf_hours=1.0)
    assert report["every_steps"] == 4  # the spacing of the auto launch's saves
    assert report["auto"]["changes"] == 1 and report["auto"]["every_steps"] == 4
    assert report["auto"]["replaced_every_steps"] == 10 and report["auto"]["replaced_overhead"] > 0
    assert "at the interval it replaced: every 10 steps, expected overhead" in render_cost(report)
