"""Where a model comes from (local folder, Hugging Face cache) and which attention implementation it gets."""

from __future__ import annotations

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
    assert local_model_path("acme/tiny") == snapshot  # the export reads the base's dtypes and files from there
    check_model_source("acme/tiny", None, None)
    assert local_model_path("acme/not-cached") is None
    with pytest.raises(ConfigError, match="not found"):
        check_model_source("acme/not-cached", None, None)


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
