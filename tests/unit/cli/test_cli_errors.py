"""Bad input to `ckpt-train`: one clear error line, a non-zero exit, no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from automodel_ckpt.cli import main

REPO = Path(__file__).resolve().parents[3]
RECIPE = str(REPO / "recipes" / "tiny_llama_sft.yaml")


def _error(capsys, argv: list[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code != 0
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and "Traceback" not in err
    return lines[0]


def test_missing_recipe(capsys, tmp_path):
    assert "recipe file not found" in _error(capsys, [str(tmp_path / "nope.yaml")])


def test_yaml_syntax_error_names_line(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("seed: 1\nstep_scheduler:\n  max_steps: 4\n   ckpt_every_steps: 2\n")
    msg = _error(capsys, [str(bad)])
    assert "bad.yaml:4" in msg


def test_unknown_key_suggests(capsys):
    msg = _error(capsys, [RECIPE, "--step_scheduler.max_stepz", "3"])
    assert "step_scheduler.max_stepz" in msg and "did you mean 'step_scheduler.max_steps'" in msg



def test_wrong_type(capsys):
    msg = _error(capsys, [RECIPE, "--step_scheduler.max_steps", "abc"])
    assert "step_scheduler.max_steps" in msg and "int" in msg and "abc" in msg


def test_missing_model_path(capsys, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(Path(RECIPE).read_text().replace("  embedded: tiny_llama\n", ""))
    msg = _error(capsys, [str(recipe), "--model.pretrained_model_name_or_path", str(tmp_path / "no_model")])
    assert "model.pretrained_model_name_or_path" in msg and "no_model" in msg


def test_missing_data_path(capsys, tmp_path):
    msg = _error(capsys, [RECIPE, "--dataset._target_", "automodel_ckpt.data.files.load_local_dataset",
                          "--dataset.path", str(tmp_path / "nodata.jsonl")])
    assert "dataset.path" in msg and "nodata.jsonl" in msg


def test_nproc_zero(capsys):
    assert "--nproc-per-node" in _error(capsys, ["--nproc-per-node", "0", RECIPE])


def test_bad_checkpoint_value(capsys):
    msg = _error(capsys, [RECIPE, "--checkpoint.model_save_format", "pickle"])
    assert "checkpoint.model_save_format" in msg and "safetensors" in msg


def test_batch_size_not_divisible(capsys):
    msg = _error(capsys, ["--nproc-per-node", "3", RECIPE])
    assert "global_batch_size" in msg and "local_batch_size" in msg


def test_debug_shows_traceback(capsys, monkeypatch):
    monkeypatch.setenv("AUTOMODEL_CKPT_DEBUG", "0")  # restored after the test: --debug sets it for the workers
    main([RECIPE, "--debug", "--step_scheduler.max_stepz", "3"])
    assert "Traceback" in capsys.readouterr().err


def test_bad_peft_value_fails_before_launch(capsys):
    msg = _error(capsys, ["--nproc-per-node", "2", str(REPO / "recipes" / "tiny_llama_peft.yaml"), "--peft.rank", "0"])
    assert "peft.rank" in msg


def test_consolidate_refuses_an_adapter_checkpoint(capsys, tmp_path):
    model = tmp_path / "epoch_0_step_4" / "model"
    model.mkdir(parents=True)
    (model / "adapter_config.json").write_text("{}")
    assert main(["consolidate", str(model.parent)]) != 0
    err = capsys.readouterr().err
    assert "PEFT adapter" in err and "merge-lora" in err
    assert not (model / "consolidated").exists()


BAD_URLS = {"checkpoint_dir": ["s3://bucket/../run", "s3://my bucket/run", "s3:///run", "s3://bucket//run",
                               "s3://bucket/run/*", "s3:/bucket/run", "s3n://bucket/run"],
            "restore_from": ["s3://bucket/run/../epoch_0_step_2"]}


@pytest.mark.parametrize("key,url", [(k, u) for k, urls in BAD_URLS.items() for u in urls])
def test_a_bad_object_store_url_is_refused_before_anything_is_built(capsys, monkeypatch, key, url):
    """Checked in the launcher, on one process and under the elastic agent: no model, data or worker is made."""
    import automodel_ckpt.cli.train as train
    import automodel_ckpt.launch as launch

    def built(*args, **kwargs):
        raise AssertionError("the launcher went on past the recipe's checks")

    for module, name in ((train, "run_worker"), (train, "fetch_models"), (launch, "launch_agent")):
        monkeypatch.setattr(module, name, built)
    for launcher in ([], ["--nproc-per-node", "2"]):
        assert main([*launcher, RECIPE, f"--checkpoint.{key}", url]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith(f"error: checkpoint.{key}: '{url}'"), err


def test_a_memory_error_is_one_line(capsys, monkeypatch):
    import automodel_ckpt.cli as cli

    def verb(argv: list[str]) -> int:
        raise MemoryError

    monkeypatch.setattr(cli, "verb_main", lambda name: verb)
    assert main(["inspect", "run"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "memory" in err
