"""What the verbs show of a streamed recipe: preview's first sequences, inspect's data position, the recipe checks."""

from __future__ import annotations

import io

import pytest

from automodel_ckpt.cli.inspect import data_position_line
from automodel_ckpt.config.loader import load_config
from automodel_ckpt.config.schema import RecipeConfig
from automodel_ckpt.data.checks import check_data_section
from automodel_ckpt.data.stream.loader import StreamLoader
from automodel_ckpt.data.stream.preview import preview_stream
from automodel_ckpt.errors import ConfigError
from tests.integration.harness import REPO
from tests.unit.data.stream.corpora import CharTokenizer, jsonl_files

RECIPE = str(REPO / "recipes" / "tiny_llama_pretrain.yaml")


def _cfg(folder, *overrides):
    return load_config(RECIPE, ["--dataset._target_", "automodel_ckpt.data.stream.corpus.streamed_corpus",
                                "--dataset.path", str(folder / "*.jsonl"), *overrides], RecipeConfig)


def test_preview_prints_the_first_sequences_of_the_run_order(tmp_path):
    folder = jsonl_files(tmp_path, files=2, rows=5)
    cfg = _cfg(folder, "--data.seq_length", "16", "--data.shuffle", "false")
    tok = CharTokenizer()
    tok.decode = lambda ids, skip_special_tokens=False: "".join(chr(t - 3) if t > 2 else "|" for t in ids)
    out = io.StringIO()
    preview_stream(cfg, tok, num=2, out=out)
    text = out.getvalue()
    assert "── sequence 0 · id" in text and "── sequence 1 · id" in text
    assert "|file 0 row 0 |" in text  # file order without shuffle; a document's end marked by EOS
    assert "streamed from 2 files" in text


def test_inspect_line_says_where_each_source_reads(tmp_path):
    folder = jsonl_files(tmp_path, files=3, rows=30)
    from automodel_ckpt.data.stream.corpus import streamed_corpus
    from automodel_ckpt.data.stream.stream import StreamSettings

    corpus = streamed_corpus(path=str(folder / "*.jsonl"))
    loader = StreamLoader(corpus, corpus.list_shards(), CharTokenizer(), StreamSettings(seq_length=16, seed=1),
                          global_batch_size=4, local_batch_size=4, dp_rank=0, dp_size=1)
    loader.next_batch()
    line = data_position_line("epoch_0_step_1", loader.summary())
    assert line.startswith("data position at epoch_0_step_1: 4 sequences; 1 lanes (this rank 1), position ")
    assert " KiB; source 0: epoch 0, shard " in line
    assert "of 3 (" in line and "64 tokens consumed" in line


def test_a_streamed_recipe_needs_max_steps_and_sane_data_keys(tmp_path):
    folder = jsonl_files(tmp_path, files=1, rows=3)
    check_data_section(_cfg(folder))
    with pytest.raises(ConfigError, match="step_scheduler.max_steps: a streamed dataset has no fixed length"):
        check_data_section(_cfg(folder, "--step_scheduler.max_steps", "null"))
    with pytest.raises(ConfigError, match="data.shuffle_buffer: expected a positive integer"):
        check_data_section(_cfg(folder, "--data.shuffle_buffer", "0"))
    with pytest.raises(ConfigError, match="data.num_workers: expected >= 0"):
        check_data_section(_cfg(folder, "--data.num_workers", "-1"))
