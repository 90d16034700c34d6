"""Both training loaders keep ``data.contract.BatchLoader``: the map-style ``GlobalBatchLoader`` and the streamed
``StreamLoader`` serve a step, save and restore their position, and say what a step's record and a checkpoint's
metadata add, so that the recipe never asks which one it has."""

from __future__ import annotations

import datasets
import torch

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


def _rows(n: int):
    pairs = [[i, i + 1] for i in range(n)]
    rows = datasets.Dataset.from_dict({"input_ids": pairs, "labels": pairs, "attention_mask": [[1, 1]] * n,
                                       "length": [2] * n, "sample_id": list(range(n))})
    return TokenizedData(rows)


def _loader(data, batch: int, world_size: int, rank: int = 0) -> GlobalBatchLoader:
    return GlobalBatchLoader(data, global_batch_size=batch, local_batch_size=2, rank=rank, world_size=world_size,
                             seed=5, shuffle=True)


def _ids(loader) -> list[int]:
    loader.next_batch()
    return loader.last_sample_ids


def test_a_new_stage_goes_on_with_the_next_samples_of_the_epochs_order_at_any_batch_and_world_size():
    """Map-style data across a stage (docs/stages.md): the position is samples of the epoch's order, so after two
    steps of 4 on 2 ranks, steps of 12 on 3 ranks serve the next 12 samples of that order; no sample of the epoch
    trained twice or skipped, the incomplete tail left for the next epoch as before."""
    data = _rows(40)
    order = torch.randperm(40, generator=torch.Generator().manual_seed(5)).tolist()
    before = _loader(data, 4, 2)
    first = _ids(before) + _ids(before)
    state = before.state_dict()
    after = [_loader(data, 12, 3, rank) for rank in range(3)]
    for loader in after:
        loader.load_state_dict(state)
        assert loader.begin_stage() is None  # the same rows: the position is kept
    assert after[0].steps_left(num_epochs=2) == 2 + 40 // 12  # 32 samples left of epoch 0, then a whole epoch
    served = [_ids(loader) for loader in after]
    assert served[0] == served[1] == served[2] == order[8:20]
    ranks = [torch.cat([mb.sample_ids for mb in loader_micro]).tolist()
             for loader_micro in (loader.next_batch()[1] for loader in after)]
    assert sorted(sum(ranks, [])) == sorted(order[20:32])  # each rank its share of the step, together all of it
    epoch0 = first + served[0] + after[0].last_sample_ids
    assert epoch0 == order[:32] and len(set(epoch0)) == 32
    assert after[0].next_batch()[0] == 1  # 8 samples left, fewer than a batch: the next epoch begins


def test_other_training_rows_at_a_new_stage_start_at_their_beginning_and_say_so():
    before = _loader(_rows(40), 4, 1)
    _ids(before)
    other = _loader(_rows(24), 4, 1)
    other.load_state_dict(before.state_dict())
    said = other.begin_stage()
    assert said is not None and "40 -> 24" in said
    assert (other.epoch, other.position) == (0, 0)
