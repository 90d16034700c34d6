"""Tracker locations: a checkpoint's ``tracking.pt`` never decides where a resumed run writes or sends its metrics.

The genuine run tracks with TensorBoard; each case rewrites its newest checkpoint's tracker state to name a place
in the case's ``Outside`` (a TensorBoard log folder, an MLflow tracking URI, in both the current and the earlier
state keys) and resumes it. The corpus guarantees: nothing is created or written there, the resumed run trains and
tracks where the recipe says, and one warning line says a new tracked run started.
"""

from __future__ import annotations

import pytest

from tests.hostile.conftest import reseal
from tests.hostile.harness import succeeded

pytest.importorskip("tensorboard")


def _plant(checkpoint, states: dict) -> None:
    import torch

    path = checkpoint / "tracking.pt"
    saved = torch.load(path, weights_only=True)
    torch.save({**saved, **states}, path)
    reseal(checkpoint)


def test_a_saved_tensorboard_folder_outside_the_run_is_never_written(make_case):
    case = make_case()
    elsewhere = str(case.outside.root / "tensorboard")
    _plant(case.checkpoint(2), {"tensorboard": {"location": elsewhere, "log_dir": elsewhere, "confirmed_step": 2}})
    outcome = case.resume("--logging.tensorboard.log_dir", "null")
    succeeded(outcome)
    assert "starting a new tracked run" in outcome.output, str(outcome)
    assert (case.run_dir / "tensorboard").is_dir()


@pytest.mark.slow  # MLflow creates its SQLite store in the run folder: about 12 s of migrations
def test_a_saved_mlflow_server_is_never_sent_the_resumed_run(make_case):
    pytest.importorskip("mlflow")
    case = make_case()
    elsewhere = f"file://{case.outside.root / 'mlruns'}"
    run_id = "0123456789abcdef0123456789abcdef"
    _plant(case.checkpoint(2), {"mlflow": {"location": elsewhere, "tracking_uri": elsewhere, "run_id": run_id,
                                           "confirmed_step": 2}})
    outcome = case.resume("--logging.tensorboard.log_dir", "null", "--logging.mlflow.experiment", "hostile",
                          env={"MLFLOW_TRACKING_TOKEN": "secret-token"})
    succeeded(outcome)
    assert "starting a new tracked run" in outcome.output, str(outcome)
    assert "secret-token" not in outcome.output
