"""A streamed corpus's bad input is one line naming file and row (or skipped and counted); a changed corpus is refused."""

from __future__ import annotations

import json
import os

import pytest

from automodel_ckpt.data.stream.corpus import streamed_corpus
from automodel_ckpt.data.stream.loader import StreamLoader, check_corpus
from automodel_ckpt.data.stream.readers import DataError
from automodel_ckpt.data.stream.stream import GlobalStream, StreamSettings
from automodel_ckpt.errors import ConfigError
from tests.unit.data.stream.corpora import CharTokenizer, jsonl_files, parquet_files

TOK = CharTokenizer()


def _stream(folder, pattern="*", **settings):
    corpus = streamed_corpus(path=str(folder / pattern))
    return GlobalStream(corpus, corpus.list_shards(), TOK, StreamSettings(seq_length=16, seed=1, shuffle=False,
                                                                          **settings))


def _drain(stream, n=200):
    for _ in range(n):
        stream.next_sequence()


def _break_row(path, row, text="{not json"):
    lines = path.read_text().splitlines()
    lines[row] = text
    path.write_text("\n".join(lines) + "\n")


def test_a_bad_json_row_is_one_line_with_file_and_row(tmp_path):
    folder = jsonl_files(tmp_path, files=2, rows=5)
    _break_row(folder / "part-01.jsonl", 3)
    with pytest.raises(DataError, match=r"part-01\.jsonl row 3: bad JSON .*--data.skip_bad_rows N") as err:
        _drain(_stream(folder))
    assert "\n" not in str(err.value)


def test_skip_bad_rows_skips_and_counts_up_to_its_limit(tmp_path):
    folder = jsonl_files(tmp_path, files=2, rows=40)  # more rows than one draw of documents reads
    _break_row(folder / "part-00.jsonl", 1)
    _break_row(folder / "part-01.jsonl", 2, json.dumps({"other": "field"}))
    stream = _stream(folder, skip_bad_rows=2)
    _drain(stream, 3)
    assert stream.position()["skipped"] == 2
    assert "part-01.jsonl row 2: no 'text', 'messages' or 'prompt'+'completion' field (has: other)" in stream.last_skip
    with pytest.raises(DataError, match=r"data.skip_bad_rows \(1\) reached"):
        _drain(_stream(folder, skip_bad_rows=1))


def test_a_file_gone_after_listing_names_the_file(tmp_path):
    folder = jsonl_files(tmp_path, files=3, rows=5)
    stream = _stream(folder)
    os.remove(folder / "part-01.jsonl")
    with pytest.raises(DataError, match=r"part-01\.jsonl: cannot open"):
        _drain(stream)


def test_an_empty_shard_and_a_truncated_parquet_file_are_one_line_each(tmp_path):
    folder = jsonl_files(tmp_path / "j", files=2, rows=5)
    (folder / "part-01.jsonl").write_text("")
    with pytest.raises(DataError, match=r"part-01\.jsonl: empty shard"):
        _drain(_stream(folder))
    pq = parquet_files(tmp_path / "p", files=2)
    data = (pq / "part-1.parquet").read_bytes()
    (pq / "part-1.parquet").write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"part-1\.parquet: not a readable parquet file"):
        _drain(_stream(pq, "*.parquet"))


def test_a_corpus_with_no_readable_row_stops_instead_of_looping(tmp_path):
    folder = jsonl_files(tmp_path, files=2, rows=3)
    for f in folder.iterdir():
        f.write_text("{bad\n" * 3)
    with pytest.raises(DataError, match="no readable row in any of the 2 shards"):
        _drain(_stream(folder, skip_bad_rows=10**9))


def test_a_glob_that_matches_nothing_and_a_bad_source_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="no files match"):
        streamed_corpus(path=str(tmp_path / "*.jsonl")).list_shards()
    with pytest.raises(ConfigError, match=r"dataset.sources\[0\]: unknown key 'wieght'"):
        streamed_corpus(sources=[{"path": "x", "wieght": 2}])
    with pytest.raises(ConfigError, match="one of dataset.path, dataset.sources, dataset.hub"):
        streamed_corpus()


def test_a_hub_dataset_id_is_read_as_its_files_urls():
    corpus = streamed_corpus(hub="HuggingFaceFW/fineweb-edu", files="sample/10BT/*.parquet")
    assert corpus.sources[0].paths == ["hf://datasets/HuggingFaceFW/fineweb-edu/sample/10BT/*.parquet"]
    pinned = streamed_corpus(hub="owner/name@refs%2Fconvert%2Fparquet", files=["a/*.jsonl", "b/*.parquet"])
    assert pinned.sources[0].paths == ["hf://datasets/owner/name@refs%2Fconvert%2Fparquet/a/*.jsonl",
                                       "hf://datasets/owner/name@refs%2Fconvert%2Fparquet/b/*.parquet"]
    assert streamed_corpus(hub="o/n").sources[0].paths == ["hf://datasets/o/n/**/*.parquet"]
    for bad in ("fineweb-edu", "o/n/extra", "../x", "o/..", "o/n@"):
        with pytest.raises(ConfigError, match="dataset.hub: expected a Hub dataset id"):
            streamed_corpus(hub=bad)
    with pytest.raises(ConfigError, match="dataset.files: expected globs inside"):
        streamed_corpus(hub="o/n", files="../../etc/*")
    with pytest.raises(ConfigError, match="one of dataset.path, dataset.sources, dataset.hub"):
        streamed_corpus(hub="o/n", path="x")


def test_a_changed_corpus_is_refused_naming_what_changed(tmp_path):
    folder = jsonl_files(tmp_path, files=3, rows=5)
    corpus = streamed_corpus(path=str(folder / "*.jsonl"))
    saved = corpus.list_shards()[0]
    with open(folder / "part-02.jsonl", "a") as f:
        f.write(json.dumps({"text": "one more"}) + "\n")
    with pytest.raises(DataError, match=r"shard '.*part-02\.jsonl' changed since the checkpoint \(size"):
        check_corpus(saved, corpus.list_shards()[0], False)
    os.remove(folder / "part-02.jsonl")
    with pytest.raises(DataError, match=r"shard '.*part-02\.jsonl' of the checkpoint's corpus is gone"):
        check_corpus(saved, corpus.list_shards()[0], False)


def test_appended_shards_are_refused_or_read_from_the_next_epoch(tmp_path):
    folder = jsonl_files(tmp_path, files=2, rows=40)
    corpus = streamed_corpus(path=str(folder / "*.jsonl"))
    settings = StreamSettings(seq_length=64, seed=1, shuffle_buffer=3)
    first = StreamLoader(corpus, corpus.list_shards(), TOK, settings, global_batch_size=4, local_batch_size=4,
                         dp_rank=0, dp_size=1)
    first.next_batch()
    state = first.state_dict()
    (folder / "part-09.jsonl").write_text("".join(json.dumps({"text": f"new {i}"}) + "\n" for i in range(4)))
    now = corpus.list_shards()
    refused = StreamLoader(corpus, now, TOK, settings, global_batch_size=4, local_batch_size=4, dp_rank=0, dp_size=1)
    with pytest.raises(DataError, match=r"1 shard\(s\) added since the checkpoint .*part-09.*allow_appended_shards"):
        refused.load_state_dict(json.loads(json.dumps(state)))
    taken = StreamLoader(corpus, now, TOK, settings, global_batch_size=4, local_batch_size=4, dp_rank=0, dp_size=1,
                         allow_appended_shards=True)
    taken.load_state_dict(json.loads(json.dumps(state)))
    seen_epochs = set()
    decoded = []
    for _ in range(60):
        epoch, micro = taken.next_batch()
        seen_epochs.add(epoch)
        decoded.append((epoch, "".join(chr(t - 3) if t > 2 else "|" for t in micro[0].input_ids.flatten().tolist())))
    assert not any("new" in text for epoch, text in decoded if epoch == 0)  # the epoch under way keeps its shards
    assert any("new" in text for epoch, text in decoded if epoch >= 1)


def test_a_malformed_position_from_a_checkpoint_is_refused_before_any_read(tmp_path):
    folder = jsonl_files(tmp_path, files=2, rows=30)
    corpus = streamed_corpus(path=str(folder / "*.jsonl"))
    settings = StreamSettings(seq_length=16, seed=1, shuffle_buffer=8)

    def loader():
        return StreamLoader(corpus, corpus.list_shards(), TOK, settings, global_batch_size=2, local_batch_size=2,
                            dp_rank=0, dp_size=1)

    first = loader()
    first.next_batch()
    good = json.loads(json.dumps(first.state_dict()))
    lane = ("positions", "0")
    for damage, what in [(lambda p: p[lane[0]][lane[1]]["sources"][0]["buffer_keys"].extend(range(10**6)),
                          "shuffle buffer"),
                         (lambda p: p[lane[0]][lane[1]]["sources"][0]["buffer_shards"].__setitem__(0, 7),
                          "shuffle buffer"),
                         (lambda p: p[lane[0]][lane[1]]["pending"].append([0, 5, 0, 0]), "pending"),
                         (lambda p: p[lane[0]][lane[1]]["sources"][0].__setitem__("pos", 99), "shard order"),
                         (lambda p: p[lane[0]][lane[1]].__setitem__("sequences", 5), "sequence count"),
                         (lambda p: p.__setitem__("positions", {}), "a lane missing"),
                         (lambda p: p["shards"][0][0].__setitem__(0, "/etc/passwd"), "gone")]:
        state = json.loads(json.dumps(good))
        damage(state)
        with pytest.raises(DataError, match=what):
            loader().load_state_dict(state)
    loader().load_state_dict(good)
