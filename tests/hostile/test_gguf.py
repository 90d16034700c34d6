"""Hostile GGUF files: every verb that reads one (inspect, verify, pack, export) refuses it in one line, lean.

Each case is a 200 MB sparse file (no disk space, but a reader that trusted it would allocate or walk it all) that
starts as a GGUF would: a header whose counts claim more entries than the file can hold, a first key whose length runs
past the end, a wrong magic or version, or a genuine tiny GGUF cut in half. Run in the corpus's limited child
processes: one ``error:`` line (verify may report instead), no traceback, and peak memory within 150 MiB of an idle
child's. A small GGUF whose header is whole but whose tensors are not (data past its end, a tensor cut short, two
tensors on the same bytes) or whose header is cut is refused by `pack` as `verify` reports it: no archive is written;
`diff` refuses it by the same check, so that it never reads the same bytes once per tensor (16,384 tensors on one
spot took minutes).
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from tests.hostile.harness import lean, refused, refused_or_reported, succeeded

BIG = 200 * 2**20


def _sparse(path: Path, head: bytes) -> Path:
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(BIG)
    return path


CASES = {
    "huge tensor count": (struct.pack("<4sIQQ", b"GGUF", 3, 2**62, 1), "tensors, more than"),
    "huge key count": (struct.pack("<4sIQQ", b"GGUF", 3, 1, 2**40), "metadata keys, more than"),
    "key longer than the file": (struct.pack("<4sIQQQ", b"GGUF", 3, 0, 1, 2**62), "damaged GGUF file"),
    "bad magic": (struct.pack("<4sIQQ", b"GGML", 3, 1, 1), "is not a GGUF file"),
    "bad version": (struct.pack("<4sIQQ", b"GGUF", 7, 1, 1), "GGUF version 7"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_gguf_is_refused_in_one_line(server, tmp_path, case):
    head, expected = CASES[case]
    path = _sparse(tmp_path / "model.gguf", head)
    for verb in (["inspect"], ["verify"], ["pack", "--out", str(tmp_path / "out.tar")], ["export"]):
        outcome = server.run([verb[0], str(path), *verb[1:]], cwd=tmp_path)
        if verb[0] == "export":  # a file that is not an archive: refused as a source, whatever it claims
            refused(outcome)
        elif verb[0] == "verify":
            refused_or_reported(outcome, expected)
        else:
            refused(outcome, expected)
        lean(outcome, server.rss)
    assert not (tmp_path / "out.tar").exists()


def _gguf(path: Path, tensors: list[tuple[str, int, int]], data: int, cut: int | None = None) -> Path:
    """A GGUF file of F32 ``tensors`` (name, elements, offset in the data area) and ``data`` bytes of data after its
    header, itself cut to ``cut`` bytes."""
    head = struct.pack("<4sIQQ", b"GGUF", 3, len(tensors), 0)
    for name, n, offset in tensors:
        head += struct.pack("<Q", len(name)) + name.encode() + struct.pack("<IQIQ", 1, n, 0, offset)
    head += b"\0" * (-len(head) % 32)  # general.alignment's default
    raw = head + b"\0" * data
    path.write_bytes(raw[:cut])
    return path


DAMAGED = {
    "data offset past the end": ([("w", 8, 2**40)], 32, None, "the file ends first"),
    "a tensor running past the end": ([("w", 8, 0), ("v", 1024, 32)], 64, None, "v: 4096 bytes"),
    "two tensors on the same bytes": ([("w", 8, 0), ("v", 8, 0)], 32, None, "overlap"),
    "two tensors partly on the same bytes": ([("w", 16, 0), ("v", 16, 32)], 96, None, "v: its bytes overlap"),
    "a header cut short": ([("w" * 100, 8, 0)], 32, 150, "damaged GGUF file"),  # in the tensor's offset
}


def test_a_genuine_small_gguf_is_packed(server, tmp_path):
    path = _gguf(tmp_path / "ok.gguf", [("w", 8, 0), ("v", 8, 32)], 64)
    succeeded(server.run(["pack", path, "--out", tmp_path / "ok.tar"], cwd=tmp_path))
    succeeded(server.run(["verify", tmp_path / "ok.tar"], cwd=tmp_path))


@pytest.mark.parametrize("case", list(DAMAGED))
def test_pack_refuses_a_gguf_that_verify_refuses(server, tmp_path, case):
    tensors, data, cut, expected = DAMAGED[case]
    path = _gguf(tmp_path / "model.gguf", tensors, data, cut)
    refused_or_reported(server.run(["verify", path], cwd=tmp_path), expected)
    refused(server.run(["pack", path, "--out", tmp_path / "out.tar"], cwd=tmp_path), expected, "model.gguf")
    assert not any(tmp_path.glob("*.tar*")) and not any(tmp_path.glob(".*tar*"))


@pytest.mark.parametrize("case", list(DAMAGED))
def test_diff_refuses_a_gguf_that_verify_refuses(server, tmp_path, case):
    tensors, data, cut, expected = DAMAGED[case]
    path = _gguf(tmp_path / "model.gguf", tensors, data, cut)
    good = _gguf(tmp_path / "good.gguf", [("w", 8, 0), ("v", 8, 32)], 64)
    for pair in ((path, path), (path, good), (good, path)):
        refused(server.run(["diff", *pair], cwd=tmp_path, timeout=20), expected, "model.gguf")


SHARED = {  # 16,384 tensors of 256 KiB each in a file of well under 1 MiB of data: 4 GiB read per side before
    "all on one spot": [(f"t{i}", 65536, 0) for i in range(16384)],
    "each overlapping the next": [(f"t{i}", 65536, 32 * i) for i in range(16384)],
}


@pytest.mark.parametrize("case", list(SHARED))
def test_diff_refuses_thousands_of_tensors_sharing_their_bytes_at_once(server, tmp_path, case):
    path = _gguf(tmp_path / "model.gguf", SHARED[case], 32 * 16384 + 2**18)
    outcome = server.run(["diff", path, path], cwd=tmp_path, timeout=20)
    refused(outcome, "its bytes overlap the previous tensor's", "(and 16382 more); it is not compared")
    lean(outcome, server.rss)
    assert outcome.wall < 10, outcome
