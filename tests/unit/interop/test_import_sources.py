"""An import source is one module and one register line: a toy source registered here is what ``read_source`` and
``ckpt-train import`` read, its run brought in the common form (weights, both Adam moments, the step, the schedule,
the data position), and its bad field refused in one line naming its file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from automodel_ckpt.errors import CheckpointError
from automodel_ckpt.interop import read_source
from automodel_ckpt.interop.contract import ImportSource
from automodel_ckpt.interop.registry import identify, register_source, source_names, unregister_source
from automodel_ckpt.interop.source import ForeignRun, Limits, Schedule, count, read_json

RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "tiny_llama_sft.yaml"
STATE = "toy_run.json"


class ToySource(ImportSource):
    """A folder holding ``toy_run.json`` (its step): one weight ``w`` and its AdamW state."""

    name = "toy"
    noun = f"a toy run folder ({STATE})"

    def detect(self, path: Path) -> bool:
        return path.is_dir() and os.path.lexists(path / STATE)

    def read(self, path: Path, limits: Limits) -> ForeignRun:
        state = read_json(path / STATE, "the toy's state", 4096)
        step = count(state.get("step"), path / STATE, "step")
        moments = {"step": torch.tensor(float(step)), "exp_avg": torch.full((2,), 0.1),
                   "exp_avg_sq": torch.full((2,), 0.01)}
        group = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "initial_lr": 1e-3,
                 "amsgrad": False, "count": 1}
        return ForeignRun(kind=f"toy run (step {step})", weights={"w": torch.ones(2)}, adapter=False,
                          moments=[moments], groups=[group], order=lambda model: ["w"],
                          schedule=Schedule("no schedule", None, why_not="the toy run records no schedule"),
                          step=step, position=lambda rows, batch: (step // (rows // batch), step % (rows // batch),
                                                                   rows // batch),
                          global_batch=None, world_size=1, rng=None)


@pytest.fixture
def toy():
    source = register_source(ToySource())
    yield source
    unregister_source(source.name)


def _toy_folder(folder: Path, step: object = 3) -> Path:
    folder.mkdir()
    (folder / STATE).write_text(json.dumps({"step": step}))
    return folder


def test_a_registered_source_is_what_read_source_reads(tmp_path, toy):
    folder = _toy_folder(tmp_path / "run")
    assert source_names()[-1] == "toy" and identify(folder) is toy
    run = read_source(folder, Limits(10))
    assert (run.kind, run.step, run.position(8, 2)) == ("toy run (step 3)", 3, (0, 3, 4))
    assert set(run.moments[0]) == {"step", "exp_avg", "exp_avg_sq"} and torch.equal(run.weights["w"], torch.ones(2))
    with pytest.raises(CheckpointError, match=r"toy_run.json': step is -1, not a count"):
        read_source(_toy_folder(tmp_path / "bad", -1), Limits(10))
    unregister_source("toy")
    with pytest.raises(CheckpointError, match=r"is neither a DeepSpeed .* HF Trainer .* nor a Lightning distributed"):
        read_source(folder, Limits(10))


def test_import_asks_the_registry_for_its_source(tmp_path, toy, capsys):
    """The verb reads the toy's folder through the registry and acts on its run: a run with no schedule of ours is
    its one-line ``lr_scheduler`` refusal, before anything is written."""
    from automodel_ckpt.cli import main

    out = tmp_path / "out"
    assert main(["import", str(_toy_folder(tmp_path / "run")), str(RECIPE), "--out", str(out)]) != 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert lines == ["error: lr_scheduler: the toy run records no schedule"]
    assert not out.exists()
