"""Where a model comes from (local folder, Hugging Face cache) and which attention implementation it gets."""

from __future__ import annotations

from pathlib import Path

import pytest

from automodel_ckpt.errors import ConfigError
from automodel_ckpt.models.build import build_causal_lm, check_model_source, local_model_path


def test_a_cached_hub_id_resolves_to_its_snapshot_folder(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--acme--tiny"
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    (snapshot / "model.safetensors").write_bytes(b"")
    assert local_model_path("acme/tiny") == snapshot  # the export reads the base's dtypes and files from there
    assert "cached" in check_model_source("acme/tiny", None, None)
    assert local_model_path("acme/not-cached") is None
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    assert "to be downloaded" in check_model_source("acme/not-cached", None, None)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert "unavailable offline" in check_model_source("acme/not-cached", None, None, offline_ok=True)
    with pytest.raises(ConfigError, match="'acme/not-cached' is neither a local folder nor in the Hugging Face cache .* hf download acme/not"):
        check_model_source("acme/not-cached", None, None)
    with pytest.raises(ConfigError, match="'./missing' not found"):
        check_model_source("./missing", None, None)


@pytest.mark.parametrize("family, asked, expected", [
    ("llama", None, "sdpa"),  # transformers' own choice for the family
    ("gpt2", "eager", "eager"),  # the recipe's model.attn_implementation
])
def test_attention_is_transformers_choice_unless_the_recipe_sets_it(family, asked, expected):
    config = {"model_type": family, "vocab_size": 32, "num_hidden_layers": 1}
    config |= {"n_embd": 32, "n_head": 2} if family == "gpt2" else {"hidden_size": 32, "num_attention_heads": 2,
                                                                      "intermediate_size": 64}
    model = build_causal_lm(config=config, attn_implementation=asked)
    assert model.config._attn_implementation == expected


RECIPES = sorted((Path(__file__).resolve().parents[4] / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.name for r in RECIPES])
def test_every_shipped_recipe_passes_dry_run_offline_with_an_empty_cache(recipe, tmp_path, monkeypatch, capsys):
    import datasets.config
    import huggingface_hub.constants

    from automodel_ckpt.cli import main

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    monkeypatch.setenv("AUTOMODEL_CKPT_ASSETS", str(tmp_path / "assets"))
    assert main([str(recipe), "--dry-run"]) == 0
    err = capsys.readouterr().err
    model_line = next(line for line in err.splitlines() if line.startswith("# model"))
    if "embedded" in recipe.read_text():
        assert "embedded base" in model_line
    else:  # a Hub id: where it lies, and how to fetch it
        assert "unavailable offline" in model_line and "hf download" in model_line
    assert not (tmp_path / "hub").exists() or not any((tmp_path / "hub").rglob("*.safetensors"))


def test_a_cached_snapshot_missing_a_shard_of_its_index_is_not_cached(tmp_path, monkeypatch):
    import json

    import huggingface_hub.constants

    from automodel_ckpt.models.hub import CACHED, DOWNLOAD, model_source

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    repo = tmp_path / "models--acme--sharded"
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    (snapshot / "config.json").write_text("{}")
    (snapshot / "model-1.safetensors").write_bytes(b"")
    weight_map = {"a": "model-1.safetensors", "b": "model-2.safetensors"}
    (snapshot / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert model_source("acme/sharded").status == DOWNLOAD  # a file-by-file cache that lacks a shard
    (snapshot / "model-2.safetensors").write_bytes(b"")
    assert model_source("acme/sharded").status == CACHED


def test_a_config_block_beside_a_folder_is_refused_in_one_line(capsys):
    """``--model.config.hidden_size 128`` on a recipe that reads a folder: not a fresh model with transformers'
    defaults for every other key, silently, but one line saying which of the two to keep."""
    from tests.unit.cli.test_cli_errors import RECIPE, _error

    line = _error(capsys, ["--nproc-per-node", "1", RECIPE, "--dry-run", "--model.config.hidden_size", "128"])
    assert line.startswith("error: model: both model.config (a new model, initialised from the seed) and "
                           "model.pretrained_model_name_or_path ('")
    assert line.endswith("tiny_llama_base', a folder's weights) are set; to build from model.config set "
                         "model.pretrained_model_name_or_path null (and tokenizer.pretrained_model_name_or_path to a "
                         "tokenizer), else remove model.config")
    with pytest.raises(ConfigError, match="both model.config"):
        build_causal_lm("some/folder", config={"hidden_size": 32})


def test_a_config_built_model_without_a_tokenizer_is_refused_before_launch(capsys):
    from tests.unit.cli.test_cli_errors import RECIPE, _error

    line = _error(capsys, ["--nproc-per-node", "1", RECIPE, "--dry-run", "--model.pretrained_model_name_or_path",
                           "null", "--model.embedded", "null", "--model.config", '{"hidden_size": 32}'])
    assert line == "error: tokenizer.pretrained_model_name_or_path: no tokenizer folder (set it, or use a model folder)"
