"""Both training loaders keep ``data.contract.BatchLoader``: the map-style ``GlobalBatchLoader`` and the streamed
``StreamLoader`` serve a step, save and restore their position, and say what a step's record and a checkpoint's
metadata add, so that the recipe never asks which one it has."""

from __future__ import annotations

import datasets

from automodel_ckpt.data.contract import BatchLoader
from automodel_ckpt.data.loader import GlobalBatchLoader
from automodel_ckpt.data.stream.corpus import streamed_corpus
from automodel_ckpt.data.stream.loader import StreamLoader
from automodel_ckpt.data.stream.stream import StreamSettings
from automodel_ckpt.data.tokenize import TokenizedData
from tests.unit.data.stream.corpora import CharTokenizer, jsonl_files


def _map_style() -> GlobalBatchLoader:
    rows = datasets.Dataset.from_dict({"input_ids": [[i, i + 1, i + 2, i + 3] for i in range(16)],
                                       "labels": [[i, i + 1, i + 2, i + 3] for i in range(16)],
                                       "attention_mask": [[1, 1, 1, 1]] * 16, "length": [4] * 16,
                                       "sample_id": list(range(16))})
    return GlobalBatchLoader(TokenizedData(rows), global_batch_size=4, local_batch_size=2, rank=0, world_size=1,
                             seed=1, shuffle=True)


def _streamed(files) -> StreamLoader:
    corpus = streamed_corpus(path=str(files / "*.jsonl"))
    return StreamLoader(corpus, corpus.list_shards(lanes=2), CharTokenizer(), StreamSettings(seq_length=16, seed=3),
                        global_batch_size=4, local_batch_size=2, dp_rank=0, dp_size=1, lanes=2)


def _keeps_the_contract(make) -> list[dict]:
    """Serve two steps, restore the position after the first into a new loader: the same second step. Returns
    the two steps' reports."""
    loader = make()
    assert isinstance(loader, BatchLoader)
    assert loader.grad_accum == 2 and loader.steps_per_epoch > 0
    epoch, micro = loader.next_batch()
    assert epoch == loader.epoch == 0 and len(micro) == loader.grad_accum
    first = loader.report(0.25)
    state = loader.state_dict()
    _, second = loader.next_batch()
    again = make()
    again.load_state_dict(state)
    _, resumed = again.next_batch()
    assert [mb.input_ids.tolist() for mb in resumed] == [mb.input_ids.tolist() for mb in second]
    return [first, loader.report(0.5)]


def test_the_map_style_loader_keeps_the_contract():
    assert _keeps_the_contract(_map_style) == [{}, {}]  # its rows were tokenized before training
    assert _map_style().summary() is None


def test_the_streamed_loader_keeps_the_contract(tmp_path):
    files = jsonl_files(tmp_path, files=2, rows=20)
    first, second = _keeps_the_contract(lambda: _streamed(files))
    assert first["data_wait_seconds"] == 0.25 and second["data_wait_seconds"] == 0.5
    assert sum(second["source_tokens"]) > sum(first["source_tokens"]) > 0
    loader = _streamed(files)
    loader.next_batch()
    assert loader.summary()["sequences"] == 4
