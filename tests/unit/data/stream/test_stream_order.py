"""The streamed corpus's global order and position: any position resumes the very same sequences (pure, no processes)."""

from __future__ import annotations

import json
import numpy as np
import pytest

from automodel_ckpt.data.stream import order
from automodel_ckpt.data.stream.corpus import streamed_corpus
from automodel_ckpt.data.stream.loader import StreamLoader
from automodel_ckpt.data.stream.order import sequence_id
from automodel_ckpt.data.stream.stream import DRAW_BATCH, GlobalStream, StreamSettings
from tests.unit.data.stream.corpora import CharTokenizer, arrow_files, jsonl_files, parquet_files, text_files

TOK = CharTokenizer()


def _run(corpus, settings, n, position=None):
    stream = GlobalStream(corpus, corpus.list_shards(), TOK, settings, position)
    seqs, positions = [], []
    for _ in range(n):
        seqs.append(stream.next_sequence())
        positions.append(stream.position())
    return seqs, positions, stream


def test_shard_order_is_a_seeded_permutation_per_epoch():
    first = order.shard_order(50, 7, 0, 0)
    assert sorted(first) == list(range(50)) and first == order.shard_order(50, 7, 0, 0)
    assert first != order.shard_order(50, 7, 0, 1) and first != order.shard_order(50, 8, 0, 0)
    assert order.shard_order(5, 7, 0, 0, shuffle=False) == [0, 1, 2, 3, 4]


def test_blend_picks_follow_the_weights():
    picks = [order.blend_pick(3, d, [1.0, 2.0, 7.0]) for d in range(20000)]
    shares = np.bincount(picks, minlength=3) / len(picks)
    assert shares == pytest.approx([0.1, 0.2, 0.7], abs=0.02)


@pytest.mark.parametrize("kind", ["jsonl", "jsonl.gz", "text", "parquet", "parquet row groups", "arrow"])
def test_every_position_resumes_the_same_sequences(tmp_path, kind):
    if kind == "arrow":
        corpus = streamed_corpus(path=str(arrow_files(tmp_path) / "*.arrow"))
    elif kind.startswith("parquet"):
        corpus = streamed_corpus(path=str(parquet_files(tmp_path) / "*.parquet"),
                                 split_parquet_mb=0 if kind.endswith("groups") else 256)
        assert len(corpus.list_shards()[0]) == (12 if kind.endswith("groups") else 3)
    elif kind == "text":
        corpus = streamed_corpus(path=str(text_files(tmp_path) / "*.txt"))
    else:
        corpus = streamed_corpus(path=str(jsonl_files(tmp_path, files=3, rows=12, gz=kind.endswith("gz")) / "part-*"))
    settings = StreamSettings(seq_length=24, seed=5, shuffle_buffer=9)
    seqs, positions, stream = _run(corpus, settings, 90)
    assert stream.epoch >= 1  # the run crossed an epoch boundary (a new shard order)
    for k in range(0, 89, 4):
        again, _, _ = _run(corpus, settings, 89 - k, positions[k])
        assert all((a == b).all() for a, b in zip(again, seqs[k + 1:])), k


def test_documents_are_joined_by_eos_and_carried_over(tmp_path):
    corpus = streamed_corpus(path=str(jsonl_files(tmp_path, files=1, rows=5) / "*.jsonl"))
    seqs, _, _ = _run(corpus, StreamSettings(seq_length=10, seed=0, shuffle=False), 12)
    flat = np.concatenate(seqs).tolist()
    docs = [[1] + [ord(c) + 3 for c in f"file 0 row {r} " + "xy" * (r % 11)] + [2] for r in range(5)]
    joined = [t for d in docs for t in d]
    assert flat[:len(joined)] == joined  # file order without shuffle; one document's tail starts the next row


def test_shuffle_buffer_reorders_rows_within_its_reach(tmp_path):
    corpus = streamed_corpus(path=str(jsonl_files(tmp_path, files=1, rows=200) / "*.jsonl"))
    stream = GlobalStream(corpus, corpus.list_shards(), TOK, StreamSettings(seq_length=8, seed=1, shuffle_buffer=16))
    taken = [stream._take(stream.sources[0]).key for _ in range(150)]
    in_order = sorted(taken)
    assert taken != in_order and len(set(taken)) == 150
    rows = [in_order.index(k) for k in taken]
    assert all(r <= i + 16 for i, r in enumerate(rows))  # a row leaves at most `buffer` rows early


def test_position_is_small_and_does_not_grow_with_progress(tmp_path):
    corpus = streamed_corpus(path=str(jsonl_files(tmp_path, files=4, rows=300) / "*.jsonl"))
    _, positions, _ = _run(corpus, StreamSettings(seq_length=16, seed=2, shuffle_buffer=32), 600)
    assert max(len(json.dumps(p)) for p in positions) < 4000
    assert all(len(p["pending"]) <= DRAW_BATCH + 1 for p in positions)  # references bounded, whatever the progress
    late = positions[-1]["sources"][0]
    assert len(late["buffer_keys"]) in (31, 32) and late["pos"] > 0  # row references, not rows


def test_blend_of_three_sources_resumes_with_its_per_source_tokens(tmp_path):
    corpus = streamed_corpus(sources=[
        {"path": str(jsonl_files(tmp_path / "a", files=2) / "*.jsonl"), "weight": 1},
        {"path": str(text_files(tmp_path / "b") / "*.txt"), "weight": 2},
        {"path": str(parquet_files(tmp_path / "c") / "*.parquet"), "weight": 3},
    ])
    settings = StreamSettings(seq_length=20, seed=9, shuffle_buffer=5)
    seqs, positions, stream = _run(corpus, settings, 60)
    tokens = stream.source_tokens()
    assert sum(tokens) == 60 * 20 and tokens[0] < tokens[1] < tokens[2]
    again, more, s2 = _run(corpus, settings, 30, positions[29])
    assert all((a == b).all() for a, b in zip(again, seqs[30:])) and s2.source_tokens() == tokens


def test_the_loader_keeps_the_position_of_its_last_step(tmp_path):
    corpus = streamed_corpus(path=str(jsonl_files(tmp_path) / "*.jsonl"))
    settings = StreamSettings(seq_length=16, seed=4, shuffle_buffer=7)
    kwargs = dict(global_batch_size=8, local_batch_size=2, dp_size=2)
    ranks = [StreamLoader(corpus, corpus.list_shards(), TOK, settings, dp_rank=r, **kwargs) for r in range(2)]
    for _ in range(3):
        for loader in ranks:
            epoch, micro = loader.next_batch()
            assert epoch == 0 and len(micro) == 2 and tuple(micro[0].input_ids.shape) == (2, 16)
    assert ranks[0].state_dict() == ranks[1].state_dict()  # one lane: both ranks read it
    assert ranks[0].state_dict()["sequences"] == 24 and ranks[0].state_dict()["positions"][0]["sequences"] == 24
    one = StreamLoader(corpus, corpus.list_shards(), TOK, settings, dp_rank=0, global_batch_size=8,
                       local_batch_size=2, dp_size=1)
    one.load_state_dict(ranks[0].state_dict())
    _, micro = one.next_batch()
    got = [sequence_id(r.numpy()) for mb in micro for r in mb.input_ids]
    want = [sequence_id(s) for s in _run(corpus, settings, 32)[0][24:32]]
    assert got == want  # one lane is the one global stream


def test_each_epoch_hands_out_every_row_once_even_with_a_buffer_larger_than_the_corpus(tmp_path):
    corpus = streamed_corpus(path=str(jsonl_files(tmp_path, files=3, rows=10) / "*.jsonl"))
    stream = GlobalStream(corpus, corpus.list_shards(), TOK, StreamSettings(seq_length=8, seed=1, shuffle_buffer=1000))
    src = stream.sources[0]
    rows = 3 * 10 + 3  # files of 10, 11 and 12 rows
    for epoch in range(3):
        taken = [stream._take(src) for _ in range(rows)]
        assert len({(d.shard, d.key) for d in taken}) == rows and src.epoch == epoch


def test_templates_render_records_and_only_the_completion_takes_the_loss(tmp_path):
    from automodel_ckpt.data.encode import IGNORE_INDEX, DataSpec
    from automodel_ckpt.data.stream.readers import DataError

    (tmp_path / "qa.jsonl").write_text("".join(json.dumps({"q": f"{i}+{i}", "a": str(2 * i)}) + "\n"
                                               for i in range(10, 40)))
    corpus = streamed_corpus(path=str(tmp_path / "qa.jsonl"))
    spec = DataSpec(seq_length=12, prompt_template="{q}=", completion_template="{a}")
    stream = GlobalStream(corpus, corpus.list_shards(), TOK, StreamSettings(seq_length=12, seed=0, shuffle=False,
                                                                          spec=spec))
    tokens = stream.next_sequence().tolist()
    labels = stream.last_labels.tolist()
    text = "".join(chr(t - 3) if t > 2 else "|" for t in tokens)
    assert text == "|10+10=20||1"  # BOS prompt completion EOS, the next record's start carried over
    trained = "".join(chr(t - 3) if t > 2 else "|" for t, y in zip(tokens, labels) if y != IGNORE_INDEX)
    assert trained == "20|"  # the completion and its EOS
    bad = streamed_corpus(path=str(tmp_path / "qa.jsonl"))
    broken = GlobalStream(bad, bad.list_shards(), TOK, StreamSettings(
        seq_length=12, seed=0, shuffle=False, spec=DataSpec(seq_length=12, prompt_template="{question}=",
                                                            completion_template="{a}")))
    with pytest.raises(DataError, match=r"qa\.jsonl' row at byte 0: .*question"):
        broken.next_sequence()


def test_row_group_shards_read_every_row_once_per_epoch(tmp_path):
    corpus = streamed_corpus(path=str(parquet_files(tmp_path, files=2, rows=25, row_group=7) / "*.parquet"),
                             split_parquet_mb=0)
    stream = GlobalStream(corpus, corpus.list_shards(), TOK, StreamSettings(seq_length=8, seed=3, shuffle_buffer=4))
    src = stream.sources[0]
    taken = [stream._take(src) for _ in range(50)]
    assert sorted((src.shards[d.shard].path, d.key) for d in taken) == sorted(
        (str(tmp_path / f"part-{f}.parquet"), r) for f in range(2) for r in range(25))
    assert src.epoch == 0 and [s.first for s in src.shards[:4]] == [0, 7, 14, 21]
