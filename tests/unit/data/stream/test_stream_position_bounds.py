"""A checkpointed stream position's fields against their real bounds: every damaged field is one line, never a
traceback (the carry-over past its document once ended in numpy's), and a genuine position resumes exactly."""

from __future__ import annotations

import copy
import gzip
import json

import pytest

from automodel_ckpt.data.stream.corpus import streamed_corpus
from automodel_ckpt.data.stream.readers import DataError
from automodel_ckpt.data.stream.stream import GlobalStream, StreamSettings
from tests.unit.data.stream.corpora import CharTokenizer, jsonl_files, parquet_files

TOK = CharTokenizer()
SETTINGS = StreamSettings(seq_length=16, seed=3, shuffle_buffer=6)


def _corpus(folder, pattern):
    corpus = streamed_corpus(path=str(folder / pattern))
    return corpus, corpus.list_shards()


def _position(corpus, shards, sequences=7):
    stream = GlobalStream(corpus, shards, TOK, SETTINGS)
    for _ in range(sequences):
        stream.next_sequence()
    return stream, json.loads(json.dumps(stream.position()))


def _resume(corpus, shards, position):
    stream = GlobalStream(corpus, shards, TOK, SETTINGS, position)
    return stream.next_sequence()


def _long_docs(folder):
    """Documents longer than a sequence, so a position carries one over (``offset`` > 0)."""
    folder.mkdir()
    for f in range(2):
        (folder / f"p{f}.jsonl").write_text("".join(json.dumps({"text": f"doc {f}.{r} " * 9}) + "\n"
                                                    for r in range(30)))
    return folder


def test_a_genuine_position_resumes_exactly(tmp_path):
    corpus, shards = _corpus(_long_docs(tmp_path / "j"), "*.jsonl")
    stream, position = _position(corpus, shards)
    assert position["offset"] > 0 and position["pending"]  # a document is carried over
    assert (_resume(corpus, shards, position) == stream.next_sequence()).all()


def _damages(position, shards):
    p = position["sources"][0]
    size = max(s.size for s in shards[0])
    first_pending = position["pending"][0]
    return {
        "the carry-over past its document": (lambda q: q.__setitem__("offset", 10**6),
                                             r"a carry-over of 1000000 tokens into '.*p\d\.jsonl' row at byte \d+, "
                                             r"a document of \d+ tokens"),
        "a carry-over with no pending document": (lambda q: (q.__setitem__("pending", []),
                                                             q.__setitem__("offset", 3)),
                                                  "a carry-over of 3 tokens and no pending document"),
        "a buffered row past its file's end": (lambda q: q["sources"][0]["buffer_keys"].__setitem__(0, size + 5),
                                               rf"shuffle buffer: a row at byte {size + 5} of '.*', a file of \d+ bytes"),
        "a pending row past its file's end": (lambda q: q["pending"][-1].__setitem__(2, 10**9),
                                              r"a pending document: a row at byte 1000000000 of '.*p\d\.jsonl'"),
        "a pending document from a later epoch": (lambda q: q["pending"][0].__setitem__(3, p["epoch"] + 1),
                                                  f"a pending document of epoch {p['epoch'] + 1}, its source is at epoch {p['epoch']}"),
        "the next row past every file": (lambda q: q["sources"][0].__setitem__("key", size + 1),
                                         rf"next row is at byte {size + 1}, past the end of its largest file"),
        "more rows than bytes": (lambda q: q["sources"][0].__setitem__("row", q["sources"][0]["key"] + 1),
                                 "more rows than bytes"),
        "tokens that do not add up": (lambda q: q["sources"][0].__setitem__("tokens", p["tokens"] + 1),
                                      rf"the sources gave {p['tokens'] + 1} tokens to 7 sequences of 16"),
        "documents that do not add up": (lambda q: q.__setitem__("docs", position["docs"] + 2),
                                         rf"{p['taken']} documents taken .*, {position['docs'] + 2} drawn"),
        "the trained epoch past every source's": (lambda q: q.__setitem__("epoch", p["epoch"] + 3),
                                                  f"of epoch {p['epoch'] + 3}, past every"),
        "a pending document of a shard the corpus lacks": (lambda q: q["pending"][0].__setitem__(1, 99),
                                                           "shard 99 of source 0, which the corpus does not have"),
    } if first_pending else {}


def test_every_damaged_field_is_one_line_before_any_read(tmp_path):
    corpus, shards = _corpus(_long_docs(tmp_path / "j"), "*.jsonl")
    _, good = _position(corpus, shards)
    damages = _damages(good, shards)
    assert len(damages) == 11
    for label, (damage, match) in damages.items():
        position = copy.deepcopy(good)
        damage(position)
        with pytest.raises(DataError, match=match) as err:
            _resume(corpus, shards, position)
        assert "malformed" in str(err.value) and "\n" not in str(err.value), label


def test_a_row_group_shard_bounds_its_row_numbers_and_compressed_offsets_are_left_to_the_read(tmp_path):
    folder = parquet_files(tmp_path / "p", files=2, rows=40, row_group=8)
    corpus = streamed_corpus(path=str(folder / "*.parquet"), split_parquet_mb=0)
    shards = corpus.list_shards()
    assert shards[0][0].stop == 8  # one shard per row group
    _, good = _position(corpus, shards)
    position = copy.deepcopy(good)
    k = position["sources"][0]["buffer_shards"][0]
    position["sources"][0]["buffer_keys"][0] = shards[0][k].stop
    with pytest.raises(DataError, match=rf"row {shards[0][k].stop} of '.*', outside its shard's rows"):
        _resume(corpus, shards, position)
    gz = jsonl_files(tmp_path / "g", files=2, rows=30, gz=True)
    corpus, shards = _corpus(gz, "*.jsonl.gz")
    _, good = _position(corpus, shards)
    position = copy.deepcopy(good)
    position["sources"][0]["buffer_keys"][0] = 10**7  # past the decompressed end: the read-back names it
    with pytest.raises(DataError, match="no longer reads"):
        _resume(corpus, shards, position)
    assert gzip  # the corpus above is gzip-compressed
