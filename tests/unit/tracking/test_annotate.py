"""Points added afterwards to a run's tracked runs (`ckpt-train eval`): where the checkpoint kept them, in its run."""

from __future__ import annotations

import os

import pytest

from automodel_ckpt.tracking import annotate
from tests.integration.trackers import tensorboard_scalars

pytest.importorskip("tensorboard")


def test_tensorboard_gets_the_points_in_the_runs_folder_and_nothing_is_purged(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    log_dir = tmp_path / "tensorboard"
    writer = SummaryWriter(str(log_dir), purge_step=1)  # as a training launch writes
    for step in (1, 2, 3, 4):
        writer.add_scalar("train/loss", 1.0 / step, step)
    writer.close()
    saved = {"tensorboard": {"log_dir": str(log_dir), "location": os.path.abspath(log_dir), "confirmed_step": 4}}
    lines = annotate({"tensorboard": {"log_dir": None}}, tmp_path, saved, {"eval/t/acc": 0.5}, 2)
    assert lines == [f"logging.tensorboard: 1 score(s) at step 2 ({os.path.abspath(log_dir)})"]
    assert tensorboard_scalars(log_dir, "eval/t/acc") == [(2, 0.5)]
    assert [s for s, _ in tensorboard_scalars(log_dir, "train/loss")] == [1, 2, 3, 4]


def test_a_run_kept_elsewhere_and_a_server_are_not_written_to(tmp_path):
    saved = {"tensorboard": {"location": "/somewhere/else"}}
    [line] = annotate({"tensorboard": {}}, tmp_path, saved, {"eval/t/acc": 0.5}, 2)
    assert "not logged (the run was tracked at /somewhere/else" in line
    assert not (tmp_path / "tensorboard").exists()
    section = {"mlflow": {"tracking_uri": "http://127.0.0.1:9/"}}
    [line] = annotate(section, tmp_path, {"mlflow": {"run_id": "a" * 32}}, {"eval/t/acc": 0.5}, 2)
    assert "not logged (http://127.0.0.1:9/ is outside the run folder; --track-outside-run" in line
    elsewhere = tmp_path.parent / f"{tmp_path.name}-tb"
    elsewhere.mkdir()
    [line] = annotate({"tensorboard": {"log_dir": str(elsewhere)}}, tmp_path, {}, {"eval/t/acc": 0.5}, 2)
    assert "is outside the run folder" in line and not any(elsewhere.iterdir())
    [line] = annotate({"tensorboard": {"log_dir": str(elsewhere)}}, tmp_path, {}, {"eval/t/acc": 0.5}, 2,
                      outside=True)
    assert line.startswith("logging.tensorboard: 1 score(s) at step 2") and any(elsewhere.iterdir())
    assert annotate({"wandb": {"mode": "offline"}}, tmp_path, {}, {"eval/t/acc": 0.5}, 2) == \
        ["logging.wandb: not logged (its history takes only increasing steps)"]
    assert annotate(None, tmp_path, {}, {"eval/t/acc": 0.5}, 2) == []
