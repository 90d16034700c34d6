"""The recipe an import writes: the source's schedule, length and optimizer groups where the user typed none."""

from __future__ import annotations

from automodel_ckpt.config.loader import load_yaml, to_yaml_data
from automodel_ckpt.interop import recipe as continuing
from automodel_ckpt.interop.source import ForeignRun, Schedule


def _run(decays=(0.1, 0.0)) -> ForeignRun:
    groups = [{"lr": 1e-3, "initial_lr": 2e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": d, "count": 3}
              for d in decays]
    schedule = Schedule("HF Trainer 'linear'", "automodel_ckpt.training.lr.linear_decay", {"warmup_steps": 2}, 10)
    return ForeignRun(kind="HF Trainer checkpoint", weights={}, adapter=False, moments=[], groups=groups,
                      order=lambda m: [], schedule=schedule, step=6, position=lambda r, b: (0, 6, 25),
                      global_batch=8, world_size=1, rng=None)


RECIPE = {"optimizer": {"_target_": "torch.optim.AdamW", "lr": 3e-3, "weight_decay": 0.0},
          "lr_scheduler": {"_target_": "automodel_ckpt.training.lr.constant_after_warmup", "warmup_steps": 0},
          "step_scheduler": {"max_steps": 40}, "checkpoint": {"restore_from": "elsewhere"}}


def test_the_source_s_needs_are_written_and_the_typed_overrides_kept(tmp_path):
    data, added = continuing.written(RECIPE, [("optimizer.eps", 1e-6)], _run(), "runs/x")
    assert added == {"lr_scheduler": {"_target_": "automodel_ckpt.training.lr.linear_decay", "warmup_steps": 2},
                     "step_scheduler.max_steps": 10, "optimizer.lr": 2e-3, "optimizer.betas": [0.9, 0.95],
                     "optimizer.weight_decay": 0.1,
                     "optimizer._target_": "automodel_ckpt.training.decay.AdamWNoDecay"}
    assert data["optimizer"]["eps"] == 1e-6  # typed: the user's
    assert data["checkpoint"] == {"enabled": True, "checkpoint_dir": "runs/x"}
    assert RECIPE["optimizer"]["weight_decay"] == 0.0  # the given recipe untouched
    path = tmp_path / "recipe.yaml"
    path.write_text(continuing.header(_run(), "src\x1b[2J\nx: 1", "r.yaml", [], added) + to_yaml_data(data))
    assert load_yaml(path) == data  # the header's newline and escape are escaped: comments only
    assert path.read_text().count("\n# ") == 2


def test_a_recipe_that_has_them_gets_nothing_and_one_decay_keeps_one_group():
    data, _ = continuing.written(RECIPE, [], _run(), "runs/x")
    assert continuing.written(data, [], _run(), "runs/x")[1] == {}
    _, added = continuing.written(RECIPE, [("lr_scheduler", {"_target_": "mine"})], _run((0.1, 0.1)), "r")
    assert "lr_scheduler" not in added and "optimizer._target_" not in added
    assert added["optimizer.weight_decay"] == 0.1


def test_no_string_the_import_adds_is_interpolated_when_the_recipe_is_loaded(tmp_path, monkeypatch):
    """A source's values reach the recipe as checked numbers; a string that would still come (a schedule's argument)
    is written escaped: loading the recipe takes it literally, never reads the environment."""
    from omegaconf import OmegaConf

    monkeypatch.setenv("IMPORT_SECRET", "leaked")
    run = _run()
    run.schedule = Schedule("x", "automodel_ckpt.training.lr.linear_decay",
                            {"warmup_steps": "${oc.env:IMPORT_SECRET}", "names": ["a${oc.env:IMPORT_SECRET}"],
                             "nested": {"k": "${oc.env:IMPORT_SECRET,x}"}}, 10)
    data, added = continuing.written(RECIPE, [], run, "runs/x")
    path = tmp_path / "recipe.yaml"
    path.write_text(to_yaml_data(data))
    loaded = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    assert loaded["lr_scheduler"]["warmup_steps"] == "${oc.env:IMPORT_SECRET}"
    assert loaded["lr_scheduler"]["names"] == ["a${oc.env:IMPORT_SECRET}"]
    assert loaded["lr_scheduler"]["nested"] == {"k": "${oc.env:IMPORT_SECRET,x}"}
    assert "leaked" not in str(loaded)
