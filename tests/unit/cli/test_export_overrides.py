"""`export --to hf-trainer` takes the recipe's dotted overrides, as every verb does; the other targets none."""

from __future__ import annotations

import pytest

from automodel_ckpt.cli import export, export_hf_trainer
from automodel_ckpt.errors import UsageError


def test_hf_trainer_export_passes_the_overrides_to_the_recipe(monkeypatch):
    seen = {}
    monkeypatch.setattr(export_hf_trainer, "export", lambda src, out, recipe, typed: seen.update(typed=typed) or 0)
    assert export.main(["ck", "--to", "hf-trainer", "--recipe", "r.yaml", "--optimizer.lr", "1e-3",
                        "--step_scheduler.max_steps=9"]) == 0
    assert seen["typed"] == ["--optimizer.lr", "1e-3", "--step_scheduler.max_steps=9"]


def test_the_other_targets_take_no_overrides():
    with pytest.raises(UsageError, match="unrecognized arguments: --optimizer.lr 1e-3"):
        export.main(["ck", "--to", "gguf", "--optimizer.lr", "1e-3"])
