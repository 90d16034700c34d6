"""A streamed corpus's hostile files: what is not a regular file, and a record of any length, compressed or not.

Each case writes a corpus folder inside the case (one good json-lines file beside the hostile one) and runs
``preview`` (which reads the stream as the run does) or a one-step run on it. The corpus guarantees: a FIFO, a
device or a socket (directly or through a link, to the ``Outside`` pipe included) is never opened, so the verb ends
long before its timeout; a line of hundreds of megabytes is read through in chunks (peak RSS within ``lean``'s
budget of an idle child) and refused in one line naming the file and the byte offset; with ``data.skip_bad_rows``
the run goes on and counts them; nothing outside the case is touched.
"""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import os
import socket
from pathlib import Path

import pytest

from tests.hostile.conftest import CODE, Case
from tests.hostile.harness import Outside, lean, refused, succeeded

PRETRAIN = CODE / "recipes" / "tiny_llama_pretrain.yaml"
FIFO_TIMEOUT = 30  # preview of a good corpus takes a few seconds; a verb blocked on a FIFO is killed then
GIANT = 256 * 2**20  # bytes of the one-line files: far past data.max_record_bytes (32 MiB)
SMALL_RUN = ("--data.num_workers", "0", "--step_scheduler.max_steps", "1", "--step_scheduler.global_batch_size",
             "2", "--step_scheduler.local_batch_size", "2", "--step_scheduler.ckpt_every_steps", "100",
             "--training.progress_bar", "false")


def _recipe(work: Path) -> Path:
    """The pretraining recipe on the case's ``data/*.jsonl*`` in file order, without a validation corpus."""
    import yaml

    recipe = yaml.safe_load(PRETRAIN.read_text())
    recipe["dataset"] = {"_target_": "automodel_ckpt.data.stream.corpus.streamed_corpus", "path": "data/*.jsonl*"}
    recipe.pop("validation_dataset", None)
    recipe["data"].update(shuffle=False, shuffle_buffer=1)
    (work / "stream.yaml").write_text(yaml.safe_dump(recipe))
    return work / "stream.yaml"


@pytest.fixture
def bare_case(server, assets, tmp_path):
    """``bare_case()``: a ``Case`` with an empty ``work/`` (no genuine run is needed to read a corpus)."""
    made: list[Case] = []

    def make() -> Case:
        root = tmp_path / f"case{len(made)}"
        (root / "work").mkdir(parents=True)
        made.append(Case(server, assets, root / "work", Outside(root / "outside")))
        return made[-1]

    yield make
    for case in made:
        case.outside.close()


def _good(data: Path) -> None:
    """The good file, read after the hostile ones (``z`` sorts last; no shuffle)."""
    data.mkdir(exist_ok=True)
    (data / "z.jsonl").write_text("".join(json.dumps({"text": f"document {i} " * 8}) + "\n" for i in range(100)))


def _fifo(data: Path, outside: Outside) -> Path:
    os.mkfifo(data / "b.jsonl")
    return data / "b.jsonl"


def _fifo_outside(data: Path, outside: Outside) -> Path:
    os.symlink(outside.pipe, data / "b.jsonl")
    return data / "b.jsonl"


def _device(data: Path, outside: Outside) -> Path:
    os.symlink("/dev/zero", data / "b.jsonl")
    return data / "b.jsonl"


def _socket(data: Path, outside: Outside) -> Path:
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(data / "b.jsonl"))
    sock.close()  # the socket file stays
    return data / "b.jsonl"


SPECIAL = {"a FIFO": _fifo, "a link to the FIFO outside": _fifo_outside, "a link to /dev/zero": _device,
           "a socket": _socket}


def _one_line(path: Path, opener, head: bytes = b"", tail: bytes = b"") -> Path:
    """A file whose content is ``head``, then one line of ``GIANT`` zeros, then ``tail``: compressed, one small
    member (gzip, bz2, xz streams concatenate) of 1 MiB zeros written over and over, so making it is cheap."""
    if opener is None:  # plain: a sparse file (NUL bytes, no newline) of that size
        with open(path, "wb") as f:
            f.write(head)
            f.truncate(len(head) + GIANT)
            f.seek(0, os.SEEK_END)
            f.write(tail)
        return path
    compress = {gzip.open: lambda b: gzip.compress(b, 1), bz2.open: lambda b: bz2.compress(b, 1),
                lzma.open: lambda b: lzma.compress(b, preset=0)}[opener]
    block = compress(b"0" * 2**20)
    with open(path, "wb") as f:
        if head:
            f.write(compress(head))
        for _ in range(GIANT // 2**20):
            f.write(block)
        if tail:
            f.write(compress(tail))
    return path


GIANTS = {"gzip": ("b.jsonl.gz", gzip.open), "bz2": ("b.jsonl.bz2", bz2.open), "xz": ("b.jsonl.xz", lzma.open),
          "plain": ("b.jsonl", None)}


def _preview(case, *extra: str):
    return case.verb("preview", _recipe(case.work), "--num", "1", *extra, timeout=FIFO_TIMEOUT)


@pytest.mark.parametrize("label", list(SPECIAL))
def test_a_file_that_is_not_regular_is_never_opened(bare_case, label):
    case = bare_case()
    _good(case.work / "data")
    hostile = SPECIAL[label](case.work / "data", case.outside)
    outcome = _preview(case)
    line = refused(outcome, str(hostile), "not a regular file")
    assert "skip_bad_rows" in line, line


@pytest.mark.parametrize("label", list(GIANTS))
def test_a_line_of_hundreds_of_megabytes_is_one_line_in_bounded_memory(bare_case, server, label):
    case = bare_case()
    _good(case.work / "data")
    name, opener = GIANTS[label]
    hostile = _one_line(case.work / "data" / name, opener)
    outcome = _preview(case)
    refused(outcome, f"{hostile} row 0", "at byte 0", "data.max_record_bytes")
    lean(outcome, server.rss)


def test_a_run_skips_and_counts_every_hostile_file_and_line(bare_case, server):
    """One run meets them all (a FIFO, a device, a socket, a giant line between two good ones) and trains on."""
    case = bare_case()
    data = case.work / "data"
    _good(data)
    os.mkfifo(data / "c.jsonl")
    os.symlink("/dev/zero", data / "d.jsonl")
    os.symlink(case.outside.pipe, data / "e.jsonl")
    good = json.dumps({"text": "a good row " * 4}).encode() + b"\n"
    _one_line(data / "f.jsonl.gz", gzip.open, head=good, tail=b"\n" + good)
    recipe = _recipe(case.work)
    one_lane = ("--data.lanes", "1")  # the bad-row budget of one stream (each lane of several keeps its own)
    outcome = case.verb(recipe, *SMALL_RUN, *one_lane, "--data.skip_bad_rows", "4", "--checkpoint.checkpoint_dir",
                        "run", timeout=120)
    succeeded(outcome)
    logs = [json.loads(line) for line in (case.work / "run" / "training.jsonl").read_text().splitlines()]
    assert max(r.get("skipped_rows", 0) for r in logs) == 4, outcome
    # the same run with one fewer allowed: one line naming the last bad one met
    again = case.verb(recipe, *SMALL_RUN, *one_lane, "--data.skip_bad_rows", "3", "--checkpoint.checkpoint_dir",
                      "run2", timeout=120)
    refused(again, "f.jsonl.gz row 1", "at byte", "data.skip_bad_rows (3) reached")
