"""Lanes: the order depends on the corpus, the seed and the lane count alone; a reader reads only its lanes' units."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from automodel_ckpt.checkpoint.restore.loader import CheckpointLoader
from automodel_ckpt.data.stream import loader as loader_module
from automodel_ckpt.data.stream import order
from automodel_ckpt.data.stream import stream as stream_module
from automodel_ckpt.data.stream.corpus import streamed_corpus
from automodel_ckpt.data.stream.loader import StreamLoader, _Share, lanes_of
from automodel_ckpt.data.stream.order import sequence_id
from automodel_ckpt.data.stream.readers import DataError
from automodel_ckpt.data.stream.stream import GlobalStream, StreamSettings, _EpochEnd
from tests.unit.data.stream.corpora import CharTokenizer, jsonl_files

TOK = CharTokenizer()
LANES, GBS = 12, 12
SETTINGS = StreamSettings(seq_length=16, seed=3, shuffle_buffer=24)


def _corpus(folder, files=4, rows=40):
    """A few files cut into byte ranges (more units than lanes)."""
    corpus = streamed_corpus(path=str(jsonl_files(folder, files=files, rows=rows) / "*.jsonl"))
    corpus.min_range_bytes = 64
    return corpus


def _loader(corpus, rank, dp, lanes=LANES, **kw):
    return StreamLoader(corpus, corpus.list_shards(lanes=lanes), TOK, SETTINGS, global_batch_size=GBS,
                        local_batch_size=1, dp_rank=rank, dp_size=dp, lanes=lanes, **kw)


def _ids(micro):
    return [sequence_id(r.numpy()) for mb in micro for r in mb.input_ids]


def _global_steps(ranks, steps):
    """Each rank's steps put back in global order (sequence k of a step: rank k mod dp)."""
    out = []
    for _ in range(steps):
        per_rank = [_ids(r.next_batch()[1]) for r in ranks]
        dp = len(ranks)
        out.append([per_rank[k % dp][k // dp] for k in range(GBS)])
    return out


def test_a_small_corpus_is_cut_into_byte_ranges_read_once_per_epoch(tmp_path):
    corpus = _corpus(tmp_path)
    units = corpus.list_shards(lanes=LANES)[0]
    assert len(units) >= LANES and all(u.stop > u.first for u in units)
    lines = {(str(p), off) for p in sorted(tmp_path.glob("*.jsonl"))
             for off in [0, *[i + 1 for i, b in enumerate(p.read_bytes()[:-1]) if b == 10]]}
    seen = []
    for lane in range(LANES):
        s = GlobalStream(corpus, [units], TOK, SETTINGS, lane=lane, lanes=LANES)
        while True:
            try:
                doc = s._read(s.sources[0])
            except _EpochEnd:
                break
            seen.append((units[doc.shard].path, doc.key))
    assert len(seen) == len(set(seen)) and set(seen) == lines  # every line once, by one lane


def test_ids_at_dp_1_equal_the_ranks_ids_at_dp_2_3_4_interleaved_and_resumed_across_them(tmp_path):
    corpus = _corpus(tmp_path)
    want = _global_steps([_loader(corpus, 0, 1)], 8)
    assert len({i for step in want for i in step}) > 6 * GBS  # (the short documents repeat a few sequences)
    for dp in (2, 3, 4):
        assert _global_steps([_loader(corpus, r, dp) for r in range(dp)], 8) == want, dp
    # DataLoader workers: 2 a rank, a rank's 3 sequences a step dealt unevenly between them
    assert _global_steps([_loader(corpus, r, 4, num_workers=2) for r in range(4)], 3) == want[:3]
    # 2 ranks for 3 steps, then 3 ranks for 3 (each lane from the file of a rank that read it), then 1 rank
    two = [_loader(corpus, r, 2) for r in range(2)]
    got = _global_steps(two, 3)
    states = [json.loads(json.dumps(r.state_dict())) for r in two]
    three = [_loader(corpus, r, 3) for r in range(3)]
    for r, loader in enumerate(three):
        loader.load_state_dict(loader.reshard_state(lambda i: states[i], 2, r, 3))
    got += _global_steps(three, 3)
    one = _loader(corpus, 0, 1)
    one.load_state_dict(one.reshard_state(lambda i: [x.state_dict() for x in three][i], 3, 0, 1))
    got += _global_steps([one], 2)
    assert got == want
    assert one.source_tokens == [8 * GBS * 16] and one.epoch == 0


@pytest.mark.parametrize("message_sequences", [4, 64])
def test_workers_send_several_steps_a_message_and_the_position_is_still_the_steps(tmp_path, monkeypatch,
                                                                                   message_sequences):
    """With few sequences a step, a worker sends several steps in one message (4: two steps of two sequences; 64:
    every step a message holds); the ids and the saved position are those of the steps taken, not of the read-ahead."""
    monkeypatch.setattr(loader_module, "MESSAGE_SEQUENCES", message_sequences)
    corpus = _corpus(tmp_path)
    want = _global_steps([_loader(corpus, 0, 1)], 6)
    ranks = [_loader(corpus, r, 3, num_workers=2) for r in range(3)]  # 4 sequences a step, 2 a worker
    got = _global_steps(ranks, 3)
    states = [json.loads(json.dumps(r.state_dict())) for r in ranks]
    again = [_loader(corpus, r, 3, num_workers=1) for r in range(3)]
    for r, loader in enumerate(again):
        loader.load_state_dict(states[r])
    assert got + _global_steps(again, 3) == want


def test_workers_of_a_rank_deal_its_sequences_each_from_its_own_lanes(tmp_path, monkeypatch):
    corpus = _corpus(tmp_path)
    want = [k for step in _global_steps([_loader(corpus, 0, 1)], 4) for k in step]
    dp, workers = 3, 2
    per_rank = []
    for rank in range(dp):
        share = _Share(corpus, corpus.list_shards(lanes=LANES), TOK, SETTINGS, {}, 0, rank, dp, GBS // dp, LANES,
                       workers)
        streams = []
        for w in range(workers):
            monkeypatch.setattr(loader_module, "get_worker_info", lambda w=w: SimpleNamespace(id=w))
            steps = iter(share)
            first = next(steps)  # started under its own worker id: one list of its items per step
            streams.append(iter([*first, *[x for _, chunk in zip(range(3), steps) for x in chunk]]))
        items = [next(streams[j % workers]) for j in range(4 * GBS // dp)]
        ends = [set(i.lanes) for i in items if i.lanes]  # a worker's first step: all its lanes; then those moved
        assert ends and all(e <= {0, 6} or e <= {3, 9} if rank == 0 else True for e in ends)  # 2 lanes per worker
        if rank == 0:
            assert ends[0] in ({0, 6}, {3, 9}) and ends[1] in ({0, 6}, {3, 9}) and ends[0] != ends[1]
        per_rank.append(items)
    assert [per_rank[k % dp][k // dp].sequence_id for k in range(4 * GBS)] == want


def test_a_reader_of_n_opens_only_its_lanes_units(tmp_path, monkeypatch):
    corpus = streamed_corpus(path=str(jsonl_files(tmp_path, files=16, rows=40) / "*.jsonl"))
    units = corpus.list_shards(lanes=16)[0]
    assert len(units) == 16  # as many files as lanes: none cut
    opened: list[str] = []
    real = stream_module.read_rows
    monkeypatch.setattr(stream_module, "read_rows", lambda path, *a, **k: (opened.append(path), real(path, *a, **k))[1])
    settings = StreamSettings(seq_length=16, seed=3, shuffle_buffer=16)
    by_rank = []
    for rank in range(4):
        opened.clear()
        loader = StreamLoader(corpus, corpus.list_shards(lanes=16), TOK, settings, global_batch_size=16,
                              local_batch_size=4, dp_rank=rank, dp_size=4, lanes=16)
        loader.next_batch()
        loader.next_batch()
        first_epoch = order.shard_order(16, 3, 0, 0)
        assert set(opened) == {units[first_epoch[lane]].path for lane in lanes_of(rank, 4, 16)}, rank
        assert len(opened) == 4  # one unit per lane, each opened once
        by_rank.append(set(opened))
    assert set.union(*by_rank) == {u.path for u in units} and sum(map(len, by_rank)) == 16  # a partition


def test_lanes_1_reads_a_position_written_before_lanes_and_another_count_is_refused(tmp_path):
    corpus = _corpus(tmp_path)
    stream = GlobalStream(corpus, corpus.list_shards(), TOK, SETTINGS)
    for _ in range(GBS * 2):
        stream.next_sequence()
    old = {"kind": "stream", "position": json.loads(json.dumps(stream.position()))}
    checkpoint = tmp_path / "epoch_0_step_2"
    checkpoint.mkdir()
    torch.save(old, checkpoint / "dataloader.pt")  # as earlier releases wrote it: once, for every rank
    one = _loader(corpus, 0, 1, lanes=1)
    restore = object.__new__(CheckpointLoader)
    restore.dims, restore.env = SimpleNamespace(dp_rank=0, dp_size=1), SimpleNamespace(is_main=True)
    restore._load_per_rank("dataloader", one, checkpoint)
    _, micro = one.next_batch()
    assert _ids(micro) == [sequence_id(stream.next_sequence()) for _ in range(GBS)]  # the same order, exactly
    with pytest.raises(DataError, match=r"one global stream .* resume it with --data.lanes 1"):
        _loader(corpus, 0, 1).load_state_dict(old)
    with pytest.raises(DataError, match=r"made over 1 lanes, this recipe says 12; .*--data.lanes 1"):
        _loader(corpus, 0, 1).load_state_dict(one.state_dict())
    with pytest.raises(DataError, match=r"made over 12 lanes, this recipe says 1"):
        twelve = _loader(corpus, 0, 2)
        twelve.next_batch()
        one.reshard_state(lambda i: twelve.state_dict(), 2, 0, 1)
