"""`ckpt-train export --to gguf`, `inspect`, `verify` and `pack` on a GGUF file, run in-process through the CLI."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from automodel_ckpt.cli import main
from automodel_ckpt.models.tiny import ensure_tiny_base


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return ensure_tiny_base(tmp_path_factory.mktemp("tiny") / "base")


@pytest.fixture(scope="module")
def q8(base, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gguf") / "tiny-q8_0.gguf"
    assert main(["export", str(base), "--to", "gguf", "--type", "q8_0", "--out", str(out), "--no-progress"]) == 0
    return out


def test_dry_run_prints_the_plan_and_writes_nothing(base, tmp_path, capsys):
    out = tmp_path / "m.gguf"
    assert main(["export", str(base), "--type", "q4_0", "--out", str(out), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "GGUF q4_0 of a llama model" in text and "39 tensors" in text and "Q4_0" in text
    assert f"would write {out}" in text and not out.exists() and not list(tmp_path.iterdir())


def test_default_out_is_beside_the_source(base, tmp_path, capsys):
    src = tmp_path / "my-model"
    src.symlink_to(base, target_is_directory=True)
    assert main(["export", str(src), "--type", "f16", "--no-progress"]) == 0
    assert (tmp_path / "my-model-f16.gguf").is_file()  # SRC-TYPE.gguf, beside SRC
    assert "GGUF written to" in capsys.readouterr().out


def test_inspect_shows_the_model_and_verify_passes(q8, capsys):
    assert main(["inspect", str(q8)]) == 0
    text = capsys.readouterr().out
    assert "llama.cpp architecture llama" in text and "block count 4" in text and "Q8_0" in text
    assert "gpt2 tokenizer, 49 tokens, chat template" in text
    assert main(["verify", str(q8)]) == 0
    assert "OK: every tensor is whole and finite" in capsys.readouterr().out


def test_verify_finds_a_tensor_of_nan(q8, tmp_path, capsys):
    import gguf

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(q8.read_bytes())
    reader = gguf.GGUFReader(bad)
    norm = next(t for t in reader.tensors if t.name == "blk.1.attn_norm.weight")
    at = int(norm.data_offset)  # from the file's start
    del reader
    with open(bad, "r+b") as f:
        f.seek(at)
        f.write(np.full(4, np.nan, dtype=np.float32).tobytes())
    assert main(["verify", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "blk.1.attn_norm.weight: holds NaN or infinite values" in out and "verify: FAILED" in out
    assert main(["verify", str(bad), "--sizes-only"]) == 0  # sizes alone cannot see it


def test_pack_holds_the_gguf_file_whole(q8, tmp_path, capsys):
    import tarfile

    out = tmp_path / "q8.tar"
    assert main(["pack", str(q8), "--out", str(out)]) == 0
    assert main(["verify", str(out)]) == 0
    with tarfile.open(out) as tar:
        member = tar.getmember(q8.name)
        assert tar.extractfile(member).read() == q8.read_bytes()
        assert member.offset_data % 4096 == 0  # mappable in place, as the archive's weights are
    assert main(["inspect", str(out)]) == 0
    assert "a GGUF file" in capsys.readouterr().out


def _one_error(capsys) -> str:
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    return lines[0]


def _tampered(q8: Path, tmp_path: Path, change) -> Path:
    data = bytearray(q8.read_bytes())
    change(data)
    out = tmp_path / "hostile.gguf"
    out.write_bytes(bytes(data))
    return out


HOSTILE = {
    "truncated": (lambda d: d.__delitem__(slice(len(d) // 2, None)), "truncated"),
    "huge tensor count": (lambda d: d.__setitem__(slice(8, 16), struct.pack("<Q", 2**62)), "tensors, more than"),
    "huge key count": (lambda d: d.__setitem__(slice(16, 24), struct.pack("<Q", 2**40)), "metadata keys, more than"),
    "string past the end": (lambda d: d.__setitem__(slice(24, 32), struct.pack("<Q", 2**62)), "damaged GGUF file"),
    "bad version": (lambda d: d.__setitem__(slice(4, 8), struct.pack("<I", 99)), "GGUF version 99"),
    "bad magic": (lambda d: d.__setitem__(slice(0, 4), b"GGML"), "is not a GGUF file"),
    "empty": (lambda d: d.__delitem__(slice(None)), "is not a GGUF file"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_gguf_is_refused_in_one_line(q8, tmp_path, capsys, case):
    change, expected = HOSTILE[case]
    path = _tampered(q8, tmp_path, change)
    for verb in ("inspect", "verify"):
        code = main([verb, str(path)])
        if verb == "verify" and code == 1 and case == "truncated":
            assert "truncated" in capsys.readouterr().out  # the header survived: reported tensor by tensor
            continue
        assert code != 0
        assert expected in _one_error(capsys), case
    assert main(["export", str(path)]) != 0  # not a source of an export
    _one_error(capsys)


def test_a_folder_of_links_exports_like_a_hugging_face_cache_folder(base, tmp_path):
    """A Hugging Face cache snapshot is links into its repository's blobs/: they are followed, no other link is."""
    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    links = repo / "snapshots" / "0123abc"
    links.mkdir(parents=True)
    for k, f in enumerate(sorted(base.iterdir())):
        (repo / "blobs" / f"blob{k}").write_bytes(f.read_bytes())
        (links / f.name).symlink_to(f"../../blobs/blob{k}")
    assert main(["export", str(links), "--type", "f16", "--out", str(tmp_path / "m.gguf"), "--no-progress"]) == 0
    assert main(["export", str(links), "--to", "int8", "--out", str(tmp_path / "int8"), "--no-progress"]) == 0
    assert (tmp_path / "int8" / "tokenizer.json").is_file() and not (tmp_path / "int8" / "tokenizer.json").is_symlink()
    plain = tmp_path / "plain"  # the same links outside a cache's layout: refused
    plain.mkdir()
    for f in base.iterdir():
        (plain / f.name).symlink_to(f)
    for to in ("gguf", "int8"):
        assert main(["export", str(plain), "--to", to, "--out", str(tmp_path / f"x-{to}"), "--no-progress"]) == 3
    assert not (tmp_path / "x-gguf").exists() and not (tmp_path / "x-int8").exists()
