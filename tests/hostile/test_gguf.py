"""Hostile GGUF files: every verb that reads one (inspect, verify, pack, export) refuses it in one line, lean.

Each case is a 200 MB sparse file (no disk space, but a reader that trusted it would allocate or walk it all) that
starts as a GGUF would: a header whose counts claim more entries than the file can hold, a first key whose length runs
past the end, a wrong magic or version, or a genuine tiny GGUF cut in half. Run in the corpus's limited child
processes: one ``error:`` line (verify may report instead), no traceback, and peak memory within 150 MiB of an idle
child's.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from tests.hostile.harness import lean, refused, refused_or_reported

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
