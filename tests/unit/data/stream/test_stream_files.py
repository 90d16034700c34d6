"""What a streamed corpus reads: regular files only, and lines and rows up to ``data.max_record_bytes``."""

from __future__ import annotations

import gzip
import json
import multiprocessing
import os
import socket

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from automodel_ckpt.data.stream import readers, regular
from automodel_ckpt.data.stream.corpus import streamed_corpus
from automodel_ckpt.data.stream.readers import DataError, bounded_lines, fetch_rows, read_rows
from automodel_ckpt.data.stream.stream import GlobalStream, StreamSettings
from tests.unit.data.stream.corpora import CharTokenizer

TOK = CharTokenizer()
GUARD_S = 60  # a reader that opens a FIFO blocks forever: the child is killed then and the test fails


def _rows(folder, skip=0, max_bytes=1000, n=4):
    """The first ``n`` sequences' documents of the corpus ``folder/*`` in file order, and the skips counted."""
    corpus = streamed_corpus(path=str(folder / "*"))
    stream = GlobalStream(corpus, corpus.list_shards(), TOK, StreamSettings(
        seq_length=16, seed=1, shuffle=False, skip_bad_rows=skip, max_record_bytes=max_bytes, one_pass=True))
    texts = ["".join(chr(t - 3) if t > 2 else "|" for t in seq.tolist()) for seq in stream]
    return "".join(texts), stream.skipped


def _guarded(fn, *args):
    """``fn(*args)`` in a forked child that must end within ``GUARD_S``: ``(ok, message)`` of what it did."""
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)

    def run():
        try:
            child.send((True, repr(fn(*args))))
        except Exception as exc:  # noqa: BLE001
            child.send((False, f"{type(exc).__name__}: {exc}"))

    proc = ctx.Process(target=run)
    proc.start()
    got = parent.poll(GUARD_S)
    if not got:
        proc.kill()
        proc.join()
        pytest.fail(f"the reader hung ({GUARD_S} s): it opened what is not a regular file")
    result = parent.recv()
    proc.join()
    return result


def _special_files(folder, outside):
    os.mkfifo(folder / "b.jsonl")
    os.symlink("/dev/zero", folder / "c.jsonl")
    os.mkfifo(outside / "pipe")
    os.symlink(outside / "pipe", folder / "d.jsonl")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(folder / "e.jsonl"))
    sock.close()


def test_only_regular_files_are_read_a_fifo_device_or_socket_is_a_bad_file(tmp_path):
    folder, outside = tmp_path / "data", tmp_path / "outside"
    folder.mkdir()
    outside.mkdir()
    (folder / "z.jsonl").write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(30)))
    _special_files(folder, outside)
    ok, message = _guarded(_rows, folder)
    assert not ok and message.startswith("DataError: ") and "\n" not in message
    assert f"{folder / 'b.jsonl'}: a FIFO, not a regular file" in message and "skip_bad_rows" in message
    ok, message = _guarded(_rows, folder, 4)
    assert ok and "doc 28" in message and message.endswith(", 4)"), message  # every special file skipped, counted
    for name, kind in (("b", "a FIFO"), ("c", "a character device"), ("d", "a FIFO"), ("e", "a socket")):
        ok, message = _guarded(lambda p: [r.error for r in read_rows(p, "json", "text", None)],
                                  str(folder / f"{name}.jsonl"))
        assert ok and f"{kind}, not a regular file" in message, (name, message)
        ok, message = _guarded(fetch_rows, str(folder / f"{name}.jsonl"), "json", "text", None, [0])
        assert not ok and f"{kind}, not a regular file" in message, (name, message)


def test_listing_a_corpus_cut_for_its_lanes_opens_no_fifo(tmp_path):
    """A small corpus is cut into row groups to fill the lanes, which reads parquet footers as it is listed: a FIFO
    named like a parquet file is not opened there either, and the read names it."""
    pq.write_table(pa.table({"text": [f"doc {i} " * 4 for i in range(40)]}), tmp_path / "z.parquet", row_group_size=8)
    os.mkfifo(tmp_path / "b.parquet")
    corpus = streamed_corpus(path=str(tmp_path / "*.parquet"))
    ok, message = _guarded(lambda: [[u.stop for u in s] for s in corpus.list_shards(lanes=64)])
    assert ok and message == "[[-1, 8, 16, 24, 32, 40]]", message  # the FIFO whole, the good file by row group
    ok, message = _guarded(lambda: [r.error for r in read_rows(str(tmp_path / "b.parquet"), "parquet", "text", None)])
    assert ok and "a FIFO, not a regular file" in message, message


def test_a_file_swapped_for_a_fifo_after_its_check_is_not_opened_blocking(tmp_path):
    path, plain = tmp_path / "a.jsonl", tmp_path / "x"
    os.mkfifo(path)
    plain.write_text("{}\n")

    def swapped():  # in the child: the check sees a regular file, the open meets the FIFO
        real = os.stat
        regular.os.stat = lambda p, *a, **k: real(plain) if p == str(path) else real(p, *a, **k)
        return [r.error for r in read_rows(str(path), "json", "text", None)]

    ok, message = _guarded(swapped)
    assert ok and "replaced while being opened" in message, message


@pytest.mark.parametrize("compressed", [False, True])
def test_a_line_longer_than_max_record_bytes_is_a_bad_row_naming_its_byte_offset(tmp_path, compressed):
    folder = tmp_path / "data"
    folder.mkdir()
    lines = [json.dumps({"text": "first " * 6}), json.dumps({"text": "x" * 5000}), json.dumps({"text": "after " * 6}),
             "0" * 4000]
    body = ("\n".join(lines)).encode()  # the last line has no newline
    name = "a.jsonl.gz" if compressed else "a.jsonl"
    (folder / name).write_bytes(gzip.compress(body) if compressed else body)
    offset = len(lines[0]) + 1
    with pytest.raises(DataError, match=rf"{name} row 1: a record of {len(lines[1]) + 1} bytes at byte {offset}, "
                                        r"over data.max_record_bytes \(1000\).*--data.skip_bad_rows N"):
        _rows(folder)
    text, skipped = _rows(folder, skip=2)
    assert "first" in text and "after" in text and "x" * 20 not in text and skipped == 2
    rows = list(read_rows(str(folder / name), "json", "text", None, max_bytes=1000))
    assert [r.key for r in rows] == [0, offset, offset + len(lines[1]) + 1, sum(len(x) + 1 for x in lines[:3])]
    assert rows[1].next_key == rows[2].key and rows[3].next_key == len(body)
    with pytest.raises(DataError, match=rf"the row at byte {offset} no longer reads \(a record of"):
        fetch_rows(str(folder / name), "json", "text", None, [offset], max_bytes=1000)
    assert fetch_rows(str(folder / name), "json", "text", None, [rows[2].key], max_bytes=1000) == \
        {rows[2].key: {"text": "after " * 6}}


def test_the_bounded_reader_splits_lines_across_chunks_and_never_holds_a_long_one(monkeypatch):
    import io

    monkeypatch.setattr(readers, "_CHUNK", 7)
    data = b"ab\n" + b"c" * 30 + b"\n\nlast-no-newline"
    got = list(bounded_lines(io.BytesIO(data), 10))
    assert got == [(b"ab\n", 3), (None, 31), (b"\n", 1), (None, 15)]
    assert list(bounded_lines(io.BytesIO(data), 15))[-1] == (b"last-no-newline", 15)
    assert list(bounded_lines(io.BytesIO(b"x" * 10 + b"\n"), 10)) == [(b"x" * 10 + b"\n", 11)]  # newline not counted
    assert sum(n for _, n in bounded_lines(io.BytesIO(data), 4)) == len(data)


def test_a_parquet_or_arrow_row_larger_than_the_bound_is_a_bad_row(tmp_path):
    table = pa.table({"text": ["small", "y" * 3000, "also small"]})
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=2)
    with pa.OSFile(str(tmp_path / "a.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    for name, fmt in (("a.parquet", "parquet"), ("a.arrow", "arrow")):
        rows = list(read_rows(str(tmp_path / name), fmt, "text", None, max_bytes=1000))
        assert [r.error is None for r in rows] == [True, False, True], name
        assert "a row of 3000 bytes, over data.max_record_bytes (1000)" in rows[1].error
        assert rows[2].record == {"text": "also small"} and rows[1].next_key == 2
        with pytest.raises(DataError, match="larger than data.max_record_bytes"):
            fetch_rows(str(tmp_path / name), fmt, "text", None, [1], max_bytes=1000)
    assert [r.key for r in read_rows(str(tmp_path / "a.parquet"), "parquet", "text", None, key=1, stop=2)] == [1]


def test_max_record_bytes_is_a_checked_recipe_key(tmp_path):
    from automodel_ckpt.config.loader import load_config
    from automodel_ckpt.config.schema import RecipeConfig
    from automodel_ckpt.data.checks import check_data_section
    from automodel_ckpt.data.stream.build import stream_settings
    from automodel_ckpt.errors import ConfigError
    from tests.integration.harness import REPO

    def cfg(*overrides):
        return load_config(str(REPO / "recipes" / "tiny_llama_pretrain.yaml"), list(overrides), RecipeConfig)

    assert stream_settings(cfg()).max_record_bytes == readers.MAX_RECORD_BYTES == 32 * 2**20
    assert stream_settings(cfg("--data.max_record_bytes", "4096")).max_record_bytes == 4096
    with pytest.raises(ConfigError, match="data.max_record_bytes: expected a positive integer"):
        check_data_section(cfg("--data.max_record_bytes", "0"))
