"""``step_scheduler.ckpt_every_steps: auto``: the interval state (checkpointed with the step counters) and the save
cycle's Young/Daly decision from measured costs, the same on every rank, each change one line and one record."""

from __future__ import annotations

import pytest

from automodel_ckpt.checkpoint import AutoInterval
from automodel_ckpt.training.step_scheduler import StepScheduler


def _steps(**kw) -> StepScheduler:
    return StepScheduler(max_steps=100, num_epochs=1, steps_per_epoch=100, ckpt_every_steps="auto", **kw)


def _saves(steps: StepScheduler, until: int, on_save=lambda s: None, tick=lambda: None,
           before_save=lambda s: None) -> list[int]:
    """The steps that save, in the save cycle's order: the schedule moves on, the interval is decided
    (``before_save``: the checkpoint holds the decision), the save is taken and measured (``on_save``)."""
    out = []
    while steps.step < until:
        steps.record_step(0, 1)
        tick()
        if steps.is_ckpt_step:
            out.append(steps.step)
            due = steps.save_interval.due(steps.step)
            steps.save_interval.scheduled(steps.step)
            if due:
                before_save(steps)
            on_save(steps)
    return out


def _auto(steps_of, cost=0.1, **kw) -> AutoInterval:
    """Young/Daly in steps, an MTBF of 8 s, half a second a step (the clock reads the step counter)."""
    return AutoInterval(lambda cost, mtbf, step: round((2 * cost * mtbf) ** 0.5 / step), mtbf_hours=8 / 3600,
                        observed_mtbf_s=lambda: None, is_main=True, say=lambda line: None, note=lambda r: None,
                        reduce_max=lambda v: list(v), clock=lambda: steps_of().step * 0.5, **kw)


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
    assert state["save_interval"] == {"every": 3, "next_step": 9, "samples": [], "mtbf": None}
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
    saves = _saves(steps, 30, lambda s: auto.measured(s, 0.1), auto.tick, auto.decide)
    # cost 0.5 s (MAX), mtbf 8 s: sqrt(2 * 0.5 * 8) = 2.83 s, at 0.5 s a step: 6 steps, decided at the second save
    # from the first one's cost
    assert saves == [2, 4, 10, 16, 22, 28] and len(notes) == 1 and notes[0]["step"] == 4
    assert notes[0]["event"] == "interval" and notes[0]["blocked_s"] == 0.5 and notes[0]["mtbf_source"] == "given"
    assert said[0].startswith(f"Checkpoint interval: every {notes[0]['every_steps']} steps (was 2): Young/Daly's")
    assert reduced[0][2] == 8.0  # the MTBF travels in the same all-reduce


def test_the_mtbf_is_the_run_s_observed_one_else_24_hours():
    notes = []
    auto = AutoInterval(lambda cost, mtbf, step: 7 if mtbf == 24 * 3600 else 5, mtbf_hours=None,
                        observed_mtbf_s=lambda: None, is_main=True, say=lambda line: None, note=notes.append,
                        reduce_max=lambda v: list(v), clock=iter(range(100)).__next__)
    steps = _steps(min_every_steps=1)
    _saves(steps, 3, lambda s: auto.measured(s, 0.01), auto.tick, auto.decide)
    assert notes[0]["every_steps"] == 7 and notes[0]["mtbf_source"] == "assumed"
    assert steps.save_interval.state_dict()["mtbf"] == [24 * 3600.0, "assumed"]  # kept with the schedule


def test_a_resume_goes_on_with_the_schedule_a_straight_run_has():
    """The checkpoint of a save holds the interval decided before it, the next due step and the samples decided
    from: a resume saves where the straight run does; its first save after the resume whatever it measures."""
    def run(steps, until, cost, take=None):
        auto = _auto(lambda: steps)

        def decide(s):
            auto.decide(s)
            if take is not None:  # the checkpoint: the state after the decision, before the save is measured
                take[s.step] = s.state_dict()

        return _saves(steps, until, lambda s: auto.measured(s, cost), auto.tick, decide)

    expected = run(_steps(min_every_steps=2, max_every_steps=50), 40, 0.1)
    # sqrt(2 x 0.1 s x 8 s) = 1.26 s at 0.5 s a step: every 3 steps, decided at the second save from the first's cost
    assert expected == [2, 4] + list(range(7, 41, 3))
    checkpoints = {}
    assert run(_steps(min_every_steps=2, max_every_steps=50), 8, 0.1, checkpoints) == [2, 4, 7]
    assert checkpoints[7]["save_interval"] == {"every": 3, "next_step": 10, "samples": [[0.1, 0.5], [0.1, 0.5]],
                                                "mtbf": [8.0, "given"]}
    for cost, saves in ((0.1, [s for s in expected if s > 7]), (5.0, None)):
        resumed = _steps(min_every_steps=2, max_every_steps=50)
        resumed.load_state_dict(checkpoints[7])
        got = run(resumed, 40, cost)
        assert got[0] == 10  # decided before the checkpoint: whatever this launch measures
        if saves is not None:
            assert got == saves  # the same costs: the same schedule throughout


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


def test_the_cost_report_and_the_end_line_use_the_run_s_mtbf_hours():
    from automodel_ckpt.tracking import cost_report, render_cost, summarize
    from automodel_ckpt.tracking.costreport import one_line

    events = [{"event": "start", "time": 0.0, "step": 0, "every_steps": 10},
              {"event": "checkpoint", "time": 5.0, "step": 10, "blocked_s": 0.5},
              {"event": "end", "time": 6.0, "step": 10, "status": "complete", "wall_s": 6.0, "blocked_s": 0.5},
              {"event": "start", "time": 7.0, "step": 10, "every_steps": "auto", "mtbf_hours": 0.001},
              {"event": "checkpoint", "time": 8.0, "step": 11, "blocked_s": 0.5},
              {"event": "interval", "time": 8.0, "step": 11, "every_steps": 4, "was_every_steps": 1},
              {"event": "checkpoint", "time": 9.0, "step": 15, "blocked_s": 0.5},
              {"event": "checkpoint", "time": 10.0, "step": 19, "blocked_s": 0.5},
              {"event": "end", "time": 11.0, "step": 19, "status": "complete", "wall_s": 4.0, "blocked_s": 1.5}]
    report = cost_report(summarize(events))
    assert report["mtbf_source"] == "configured" and report["mtbf_s"] == pytest.approx(3.6)  # the run's, not 24 h
    assumed = cost_report(summarize([{k: v for k, v in r.items() if k != "mtbf_hours"} for r in events]))
    assert assumed["mtbf_source"] == "assumed" and assumed["auto"]["overhead"] < report["auto"]["overhead"]
    auto = report["auto"]
    assert auto["overhead"] < auto["replaced_overhead"]  # every 4 steps beats every 10 at a 3.6 s MTBF
    line = one_line(report)
    assert "MTBF 3.60 s (the run's checkpoint.mtbf_hours)" in line
    assert (f"ckpt_every_steps auto: saves every 4 steps, expected overhead {100 * auto['overhead']:.2f}% against "
            f"{100 * auto['replaced_overhead']:.2f}% at the fixed every 10 steps it replaced") in line
    assert f"expected overhead {100 * auto['overhead']:.2f}%" in render_cost(report)
    assert cost_report(summarize(events), mtbf_hours=2.0)["mtbf_source"] == "given"  # --mtbf-hours wins


def test_the_node_local_tier_s_auto_interval_is_its_own_schedule_decided_from_its_steps_costs():
    from automodel_ckpt.training.step_scheduler import SaveInterval

    notes, said = [], []
    steps = _steps(min_every_steps=2)  # the durable schedule: untouched by the local tier's
    schedule = steps.local_interval = SaveInterval(1, 5)
    auto = AutoInterval(lambda cost, mtbf, step: round((2 * cost * mtbf) ** 0.5 / step), mtbf_hours=8 / 3600,
                        observed_mtbf_s=lambda: None, is_main=True, say=said.append, note=notes.append,
                        reduce_max=lambda v: list(v), clock=lambda: steps.step * 0.5, schedule=schedule)
    taken = []
    while steps.step < 20:  # what LocalTier.due / scheduled / measured do
        steps.record_step(0, 1)
        auto.tick()
        if schedule.due(steps.step):
            taken.append(steps.step)
            schedule.scheduled(steps.step)
            auto.decide(steps)
            auto.measured(steps, 0.1)
    # sqrt(2 x 0.1 s x 8 s) = 1.26 s at 0.5 s a step: every 3, decided at the third local step (the first came
    # before any step time was measured, so the second had no sample to decide from)
    assert taken == [1, 2, 3, 6, 9, 12, 15, 18]
    assert notes[0]["event"] == "local_interval" and said[0].startswith("Node-local interval: every 3 steps (was 1)")
    assert "blocked a local step" in said[0]
    assert steps.save_interval.state_dict()["samples"] == []  # the durable interval's own state is its own
    again = _steps(min_every_steps=2)
    again.local_interval = SaveInterval(1, 5)
    again.load_state_dict(steps.state_dict())
    assert again.local_interval.state_dict() == schedule.state_dict()  # checkpointed with the step counters


def test_the_node_local_keys_are_checked_in_one_line():
    from automodel_ckpt.checkpoint import CheckpointConfig
    from automodel_ckpt.checkpoint.config import LocalTierConfig
    from automodel_ckpt.errors import ConfigError

    assert LocalTierConfig(every_steps="Auto").every_steps == "auto"
    assert LocalTierConfig(every_steps=4).every_steps == 4
    for kwargs, expected in (({"every_steps": "often"}, "checkpoint.local.every_steps: expected a whole number >= 0 "
                                                        "or auto, got 'often'"),
                             ({"every_steps": 2.5}, "checkpoint.local.every_steps: expected"),
                             ({"every_steps": -1}, "checkpoint.local.every_steps: expected a whole number >= 0"),
                             ({"every_steps": "auto", "min_every_steps": 0}, "checkpoint.local.min_every_steps: "),
                             ({"every_steps": "auto", "min_every_steps": 4, "max_every_steps": 2},
                              "checkpoint.local.max_every_steps: expected a whole number >= min_every_steps (4)")):
        with pytest.raises(ConfigError) as caught:
            LocalTierConfig(**kwargs)
        assert expected in str(caught.value) and "\n" not in str(caught.value)
    assert CheckpointConfig(local=LocalTierConfig(every_steps="auto")).local.every_steps == "auto"


# --- a restored schedule is untrusted: every number checked, out of range dropped or clamped, and said ---------------

NAN, INF = float("nan"), float("inf")
HOSTILE = [NAN, INF, -INF, -1, 0, 1e308, -1e308, "3", "nan", True, False, None, 2**62, 10**400, 10**5000, [3], {"a": 1},
           3.0]
def _id(value) -> str:
    return f"int of {value.bit_length()} bits" if type(value) is int and value.bit_length() > 64 else repr(value)[:12]


GENUINE_AT_4 = {"step": 4, "epoch": 0, "consumed_samples": 4,
                "save_interval": {"every": 3, "next_step": 7, "samples": [[0.1, 0.5], [0.1, 0.5]],
                                  "mtbf": [8.0, "given"]}}


def _poisoned(where: str, value) -> dict:
    import copy

    state = copy.deepcopy(GENUINE_AT_4)
    interval = state["save_interval"]
    if where in ("every", "next_step", "samples", "mtbf"):
        interval[where] = value
    elif where == "sample":
        interval["samples"][0] = value
    elif where == "cost":
        interval["samples"][0][0] = value
    elif where == "step time":
        interval["samples"][1][1] = value
    elif where == "mtbf seconds":
        interval["mtbf"][0] = value
    elif where == "mtbf source":
        interval["mtbf"][1] = value
    return state


def _resume(state: dict, *, max_steps: int = 8, mtbf_hours=None, observed=lambda: None, cost: float = 0.1):
    """A run of ``max_steps`` resumed from ``state`` with the real Young/Daly rule (``tracking.advise``), the save
    cycle's calls in its order: the saves, the lines said, the records noted, the schedule."""
    from automodel_ckpt.tracking import advise

    steps = StepScheduler(max_steps=max_steps, num_epochs=1, steps_per_epoch=max_steps, ckpt_every_steps="auto",
                          min_every_steps=2, max_every_steps=None)
    steps.load_state_dict(state)
    said, notes = [], []
    auto = AutoInterval(lambda c, m, s: advise(c, m, s).interval_steps, mtbf_hours=mtbf_hours, observed_mtbf_s=observed,
                        is_main=True, say=said.append, note=notes.append, reduce_max=lambda v: list(v),
                        clock=lambda: steps.step * 0.5)
    saves = []
    while not steps.done:
        steps.record_step(0, 1)
        auto.tick(steps)
        if steps.is_ckpt_step:
            saves.append(steps.step)
            due = steps.save_interval.due(steps.step)
            steps.save_interval.scheduled(steps.step)
            if due:
                auto.decide(steps)
            auto.measured(steps, cost)
    return saves, said, notes, steps.save_interval


def _sane(interval, last_step: int = 8) -> None:
    import math

    assert type(interval.every) is int and 1 <= interval.every <= last_step
    assert type(interval.next_step) is int
    assert all(len(s) == 2 and all(type(v) is float and math.isfinite(v) and 0 <= v <= 1e7 for v in s) and s[1] > 0
               for s in interval.samples) and len(interval.samples) <= interval.SAMPLES
    assert interval.mtbf is None or (math.isfinite(interval.mtbf[0]) and interval.mtbf[0] > 0
                                     and interval.mtbf[1] in ("given", "observed", "assumed"))


@pytest.mark.parametrize("value", HOSTILE, ids=_id)
@pytest.mark.parametrize("where", ["every", "next_step", "samples", "sample", "cost", "step time", "mtbf",
                                   "mtbf seconds", "mtbf source"])
def test_a_restored_schedule_out_of_range_is_dropped_or_clamped_in_one_warning_never_a_traceback(where, value):
    saves, said, notes, interval = _resume(_poisoned(where, value))
    assert saves and saves[-1] == 8 and all(4 < s <= 8 for s in saves) and len(saves) == len(set(saves))
    _sane(interval)
    warnings_said = [line for line in said if line.startswith("warning:")]
    assert len(warnings_said) <= 1 and all("\n" not in line for line in said)
    for record in notes:  # the interval records hold whole numbers in range
        assert type(record["every_steps"]) is int and 1 <= record["every_steps"] <= 8
    again = StepScheduler(max_steps=8, num_epochs=1, steps_per_epoch=8, ckpt_every_steps="auto", min_every_steps=2)
    again.load_state_dict({"step": 8, "epoch": 0, "consumed_samples": 8,
                           "save_interval": interval.state_dict()})  # what it saves is in range
    assert again.save_interval.restored_note is None or "'next_step'" in again.save_interval.restored_note


@pytest.mark.parametrize("where,value,says", [
    ("every", NAN, "'every' is nan"), ("every", "3", "'every' is '3'"), ("every", True, "'every' is True"),
    ("every", 0, "'every' is 0"), ("every", -1, "'every' is -1"), ("every", 2**62, "'every' is 4611686018427387904"),
    ("every", 10**7, "past the run's last step 8"), ("next_step", NAN, "'next_step' is nan"),
    ("next_step", None, "'next_step' is None"), ("next_step", 0, "outside steps 5 to 7"),
    ("next_step", 4, "outside steps 5 to 7"), ("next_step", -1, "outside steps 5 to 7"),
    ("cost", NAN, "1 of its 2 cost samples dropped"), ("cost", -1, "1 of its 2 cost samples dropped"),
    ("cost", 1e308, "1 of its 2 cost samples dropped"), ("cost", "3", "1 of its 2 cost samples dropped"),
    ("step time", 0, "1 of its 2 cost samples dropped"), ("step time", INF, "1 of its 2 cost samples dropped"),
    ("sample", None, "1 of its 2 cost samples dropped"), ("sample", [1.0], "1 of its 2 cost samples dropped"),
    ("samples", "3", "'samples' is '3', not a list"), ("mtbf seconds", 0, "'mtbf' is a list"),
    ("mtbf seconds", NAN, "'mtbf' is a list"), ("mtbf seconds", 1e308, "'mtbf' is a list"),
    ("mtbf seconds", -1, "'mtbf' is a list"), ("mtbf seconds", True, "'mtbf' is a list"),
    ("mtbf source", "mine", "'mtbf' is a list"), ("mtbf", "24", "'mtbf' is '24'"),
])
def test_what_was_out_of_range_is_said_once_with_the_interval_the_run_uses(where, value, says):
    state = _poisoned(where, value)
    steps = StepScheduler(max_steps=8, num_epochs=1, steps_per_epoch=8, ckpt_every_steps="auto", min_every_steps=2)
    steps.load_state_dict(state)
    note = steps.save_interval.restored_note
    assert note is not None and says in note and "\n" not in note, note
    assert note.endswith(f"saves every {steps.save_interval.every} steps, the next at step "
                         f"{steps.save_interval.next_step}")
    _, said, _, _ = _resume(state)
    assert len(said) >= 1 and said[0].startswith("warning: Checkpoint interval: the checkpoint's schedule was out of "
                                                 "range: ") and says in said[0]
    assert sum(line.startswith("warning:") for line in said) == 1  # said once, at the first step after the resume


def test_a_restored_next_save_of_2_62_is_clamped_to_the_interval_and_announced():
    """Trusted, the resumed run would save only at its end, silently: it saves every 3 steps from the resume."""
    saves, said, _, interval = _resume(_poisoned("next_step", 2**62))
    assert saves == [7, 8]
    assert said[0] == ("warning: Checkpoint interval: the checkpoint's schedule was out of range: 'next_step' is "
                       "4611686018427387904, outside steps 5 to 7: saves every 3 steps, the next at step 7")
    straight, said, _, _ = _resume(GENUINE_AT_4)
    assert straight == saves and not [line for line in said if line.startswith("warning:")]  # the genuine one


def test_ten_million_restored_samples_are_not_read_one_by_one():
    import time

    state = _poisoned("samples", [[NAN, 0.5]] * (10**7 - 8) + [[0.1, 0.5]] * 8)
    steps = StepScheduler(max_steps=8, num_epochs=1, steps_per_epoch=8, ckpt_every_steps="auto", min_every_steps=2)
    started = time.perf_counter()
    steps.load_state_dict(state)
    assert time.perf_counter() - started < 0.5  # the last 8 looked at, not ten million
    assert steps.save_interval.samples == [[0.1, 0.5]] * 8
    assert "9999992 of its 10000000 cost samples dropped" in steps.save_interval.restored_note


@pytest.mark.parametrize("value", [NAN, INF, -1, 1e308, "3", True, None, [4], 2**62, 10**5000, 4.0], ids=_id)
@pytest.mark.parametrize("key", ["step", "epoch", "consumed_samples"])
def test_restored_step_counters_out_of_range_are_refused_in_one_line(key, value):
    from automodel_ckpt.errors import CheckpointError

    steps = _steps()
    with pytest.raises(CheckpointError) as refused:
        steps.load_state_dict({**GENUINE_AT_4, key: value})
    assert f"'{key}'" in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(CheckpointError):
        steps.load_state_dict([4, 0, 4])


@pytest.mark.parametrize("mtbf_s", [NAN, INF, -1.0, 0.0, 1e308, -1e308])
def test_an_observed_mtbf_out_of_range_is_not_used(mtbf_s):
    state = _poisoned("mtbf", None)  # decided again at the next save: from the run's cost log
    saves, said, notes, interval = _resume(state, observed=lambda: mtbf_s)
    _sane(interval)
    assert interval.mtbf[1] == "assumed" and interval.mtbf[0] == 24 * 3600.0


@pytest.mark.parametrize("cost,step_s,mtbf_hours", [
    (1e7, 1e-300, 1e9), (0.0, 1e-300, 1e-300), (1e7, 1e7, 1e9), (5e-324, 5e-324, 1e9), (1e-300, 1e7, 1e-300)])
def test_the_interval_is_a_whole_number_from_1_to_the_last_step_whatever_the_numbers(cost, step_s, mtbf_hours):
    state = _poisoned("samples", [[cost, step_s]] * 8)
    saves, said, notes, interval = _resume(state, mtbf_hours=mtbf_hours, cost=cost)
    _sane(interval)
    assert saves[-1] == 8


@pytest.mark.parametrize("hours", [NAN, INF, -1.0, 0.0, 1e308, 1e10, True, "3"])
def test_the_configured_mtbf_is_a_finite_number_of_hours(hours):
    from automodel_ckpt.checkpoint import CheckpointConfig
    from automodel_ckpt.errors import ConfigError

    with pytest.raises(ConfigError) as caught:
        CheckpointConfig(mtbf_hours=hours)
    assert "checkpoint.mtbf_hours" in str(caught.value) and "\n" not in str(caught.value)
    assert CheckpointConfig(mtbf_hours=1e6).mtbf_hours == 1e6


def test_young_daly_in_steps_never_overflows():
    from automodel_ckpt.tracking import advise

    assert advise(1e7, 3.6e12, 1e-300).interval_steps == 1 << 62
    assert advise(1e300, 1e300, 1.0).interval_steps == 1 << 62
    assert advise(0.1, 8.0, 0.5).interval_steps == 3
    for bad in ((NAN, 1.0, 1.0), (1.0, INF, 1.0), (1.0, 1.0, 0.0), (1.0, 1.0, NAN), (-1.0, 1.0, 1.0)):
        with pytest.raises(ValueError):
            advise(*bad)


@pytest.mark.parametrize("value", [1e308, INF, NAN, -1.0, "3", True])
def test_the_cost_report_of_a_log_out_of_range_is_no_traceback(value):
    from automodel_ckpt.tracking import cost_report, render_cost, summarize
    from automodel_ckpt.tracking.costreport import one_line

    events = [{"event": "start", "time": 0.0, "step": 0, "every_steps": "auto", "mtbf_hours": value},
              {"event": "checkpoint", "time": 5.0, "step": 10, "blocked_s": 0.5},
              {"event": "checkpoint", "time": 6.0, "step": 20, "blocked_s": 0.5},
              {"event": "interval", "time": 6.0, "step": 20, "every_steps": 4, "was_every_steps": 1},
              {"event": "end", "time": 7.0, "step": 20, "status": "complete"}]
    report = cost_report(summarize(events))
    assert report["mtbf_source"] == "assumed"  # an MTBF out of range is not the run's
    assert report["advice"]["interval_steps"] >= 1 and one_line(report) and render_cost(report)
    events[1]["blocked_s"] = events[2]["blocked_s"] = 1e308  # a mean cost of infinity: no advice, no traceback
    assert cost_report(summarize(events))["advice"] is None
