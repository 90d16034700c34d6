"""Collective steps: a failure reaches every rank, interrupts still meet the collective, --debug keeps tracebacks."""

from __future__ import annotations

import pytest

from automodel_ckpt.distributed import collective
from automodel_ckpt.cli import run
from automodel_ckpt.distributed import env
from automodel_ckpt.errors import CheckpointError


def _deep_failure() -> None:
    raise ValueError("disk said no")


def test_a_failure_raises_one_line_chained_to_the_original(monkeypatch):
    monkeypatch.delenv("AUTOMODEL_CKPT_DEBUG", raising=False)
    with pytest.raises(CheckpointError) as err:
        collective.collectively(_deep_failure, "writing 'x'", 0)
    assert str(err.value) == "writing 'x' failed on rank 0: ValueError: disk said no"
    assert isinstance(err.value.__cause__, ValueError)  # --debug prints the chain


def test_debug_shows_the_original_traceback(monkeypatch, capsys):
    monkeypatch.setenv("AUTOMODEL_CKPT_DEBUG", "0")  # restored after the test

    def verb(argv: list[str]) -> int:
        collective.collectively(_deep_failure, "writing 'x'", 0)
        return 0

    assert run(verb, ["--debug"]) == CheckpointError.exit_code
    err = capsys.readouterr().err
    assert "in _deep_failure" in err and "ValueError: disk said no" in err
    assert err.rstrip().splitlines()[-1] == "error: writing 'x' failed on rank 0: ValueError: disk said no"


def test_without_debug_the_failure_is_one_line(monkeypatch, capsys):
    monkeypatch.delenv("AUTOMODEL_CKPT_DEBUG", raising=False)

    def verb(argv: list[str]) -> int:
        collective.collectively(_deep_failure, "writing 'x'", 0)
        return 0

    assert run(verb, []) == CheckpointError.exit_code
    assert capsys.readouterr().err == "error: writing 'x' failed on rank 0: ValueError: disk said no\n"


def test_debug_carries_another_ranks_traceback(monkeypatch):
    monkeypatch.setenv("AUTOMODEL_CKPT_DEBUG", "1")
    remote = "ValueError: disk said no\nTraceback (most recent call last):\n  File \"x.py\", line 1, in _deep_failure\n"
    monkeypatch.setattr(env, "all_gather_object", lambda error: [error, remote])
    with pytest.raises(CheckpointError) as err:
        collective.collectively(lambda: None, "writing 'x'", 0)
    text = str(err.value)
    assert text.startswith("writing 'x' failed on rank 1: ValueError: disk said no\n") and "in _deep_failure" in text


def test_an_interrupt_on_rank_0_still_reaches_the_broadcast(monkeypatch):
    sent = []
    monkeypatch.setattr(env, "broadcast_object", lambda payload: sent.append(payload) or payload)

    def interrupted() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        collective.on_main(interrupted, "publishing the checkpoint", 0)
    assert sent == [(False, "interrupted")]  # the other ranks are told, instead of waiting forever


def test_the_other_ranks_raise_when_rank_0_was_interrupted(monkeypatch):
    monkeypatch.setattr(env, "broadcast_object", lambda payload: (False, "interrupted"))
    with pytest.raises(CheckpointError, match="publishing the checkpoint failed on rank 0: interrupted"):
        collective.on_main(lambda: 1, "publishing the checkpoint", 1)


def test_an_interrupt_inside_a_collective_step_still_reaches_the_gather(monkeypatch):
    gathered = []
    monkeypatch.setattr(env, "all_gather_object", lambda error: gathered.append(error) or [error, None])

    def interrupted() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        collective.collectively(interrupted, "syncing", 0)
    assert gathered == ["interrupted"]


def test_results_reach_every_rank(monkeypatch):
    monkeypatch.setattr(env, "broadcast_object", lambda payload: (True, 42))
    assert collective.on_main(lambda: 1, "x", 1) == 42
    assert collective.collectively(lambda: 7, "x", 0) == 7


def test_gathered_hands_every_rank_each_result_and_raises_a_failure_everywhere(monkeypatch):
    monkeypatch.delenv("AUTOMODEL_CKPT_DEBUG", raising=False)
    monkeypatch.setattr(env, "all_gather_object", lambda outcome: [outcome, (None, {"b": 2})])
    assert collective.gathered(lambda: {"a": 1}, "naming", 0) == [{"a": 1}, {"b": 2}]
    monkeypatch.setattr(env, "all_gather_object", lambda outcome: [outcome, ("ValueError: no key", None)])
    with pytest.raises(CheckpointError, match="naming failed on rank 1: ValueError: no key"):
        collective.gathered(lambda: {"a": 1}, "naming", 0)
