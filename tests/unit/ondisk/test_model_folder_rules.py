"""The rules for a model folder the user names (``paths.model_file_in``) and for a GGUF header (``gguf_read``)."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest

from automodel_ckpt.ondisk import paths
from automodel_ckpt.export import gguf_read
from automodel_ckpt.errors import CheckpointError


def _snapshot(root: Path) -> tuple[Path, Path]:
    repo = root / "models--org--m"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "abc").write_text("{}")
    snapshot = repo / "snapshots" / "rev"
    snapshot.mkdir(parents=True)
    return repo, snapshot


def test_a_cache_snapshot_link_is_read_as_its_blob(tmp_path):
    repo, snapshot = _snapshot(tmp_path)
    os.symlink("../../blobs/abc", snapshot / "config.json")
    (snapshot / "plain.json").write_text("{}")
    assert paths.model_file_in(snapshot, "config.json", "x") == repo / "blobs" / "abc"
    assert paths.model_file_in(snapshot, "plain.json", "x") == snapshot / "plain.json"
    linked = tmp_path / "named"  # the folder the user names may itself be a link
    os.symlink(snapshot, linked)
    assert paths.model_file_in(linked, "config.json", "x") == repo / "blobs" / "abc"
    with pytest.raises(FileNotFoundError):
        paths.model_file_in(snapshot, "missing.json", "x")


@pytest.mark.parametrize("case", ["outside", "blob is a link", "blobs is a link", "not a snapshot", "into a subfolder",
                                  "a fifo", "another repository"])
def test_every_other_link_or_special_file_is_one_line(tmp_path, case):
    repo, snapshot = _snapshot(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "abc").write_text("secret")
    name = snapshot / "config.json"
    if case == "outside":
        os.symlink(elsewhere / "abc", name)
    elif case == "blob is a link":
        (repo / "blobs" / "abc").unlink()
        os.symlink(elsewhere / "abc", repo / "blobs" / "abc")
        os.symlink("../../blobs/abc", name)
    elif case == "blobs is a link":
        os.rename(repo / "blobs", tmp_path / "real-blobs")
        os.symlink(elsewhere, repo / "blobs")
        os.symlink("../../blobs/abc", name)
    elif case == "not a snapshot":
        name = tmp_path / "folder" / "config.json"
        name.parent.mkdir()
        os.symlink(repo / "blobs" / "abc", name)
    elif case == "into a subfolder":
        (repo / "blobs" / "sub").mkdir()
        (repo / "blobs" / "sub" / "abc").write_text("{}")
        os.symlink("../../blobs/sub/abc", name)
    elif case == "a fifo":
        os.mkfifo(name)
    else:
        other, _ = _snapshot(tmp_path / "other")
        os.symlink(other / "blobs" / "abc", name)
    with pytest.raises(CheckpointError, match="not a regular file or a link into its Hugging Face cache") as err:
        paths.model_file_in(name.parent, name.name, "replace it")
    assert "\n" not in str(err.value) and str(err.value).endswith("replace it")


# --- a GGUF header -----------------------------------------------------------------------------------------------


def _kv(key: str, kind: int, payload: bytes) -> bytes:
    return struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", kind) + payload


def _string(text: str) -> bytes:
    return struct.pack("<Q", len(text.encode())) + text.encode()


def _gguf(path: Path, kvs: list[bytes], tensors: int = 0, tail: bytes = b"") -> Path:
    path.write_bytes(struct.pack("<4sIQQ", b"GGUF", 3, tensors, len(kvs)) + b"".join(kvs) + tail)
    return path


def test_the_header_is_walked_without_holding_arrays(tmp_path):
    tokens = struct.pack("<IQ", 8, 3) + b"".join(_string(t) for t in ("a", "b", "c"))
    nested = struct.pack("<IQ", 9, 2) + struct.pack("<IQ", 0, 2) + b"\1\2" + struct.pack("<IQ", 0, 0)
    path = _gguf(tmp_path / "m.gguf", [_kv("general.architecture", 8, _string("llama")),
                                       _kv("general.name", 8, _string("x" * 10_000)),  # skipped, not read
                                       _kv("tokenizer.ggml.tokens", 9, tokens), _kv("general.nested", 9, nested),
                                       _kv("llama.block_count", 4, struct.pack("<I", 4))])
    info = gguf_read.describe_gguf(path)
    assert (info["architecture"], info["name"], info["vocabulary"], info["block_count"]) == ("llama", None, 3, 4)
    assert info["metadata_keys"] == 5 and info["tensors"] == 0
    assert isinstance(gguf_read.open_gguf(path).values["general.nested"], gguf_read.GGUFArray)


@pytest.mark.parametrize("case, expected", [
    ("string past the end", "runs past the end"),
    ("array over the cap", "holds an array of"),
    ("unknown value type", "unknown value type 13"),
    ("a key twice", "twice"),
    ("alignment not a power of two", "not a power of two"),
    ("unknown tensor type", "unknown type"),
])
def test_a_damaged_header_is_one_line(tmp_path, case, expected):
    tensors, tail = 0, b""
    if case == "string past the end":
        kvs = [_kv("general.name", 8, struct.pack("<Q", 10**6) + b"short")]
    elif case == "array over the cap":
        kvs = [_kv("a", 9, struct.pack("<IQ", 0, gguf_read.MAX_ARRAY + 1))]
        tail = bytes(gguf_read.MAX_ARRAY + 1)
    elif case == "unknown value type":
        kvs = [_kv("a", 13, b"\0" * 8)]
    elif case == "a key twice":
        kvs = [_kv("a", 4, b"\0" * 4), _kv("a", 4, b"\0" * 4)]
    elif case == "alignment not a power of two":
        kvs = [_kv("general.alignment", 4, struct.pack("<I", 24))]
    else:
        kvs, tensors = [_kv("a", 4, b"\0" * 4)], 1
        tail = _string("t") + struct.pack("<IQIQ", 1, 32, 9999, 0) + bytes(64)
    path = _gguf(tmp_path / "m.gguf", kvs, tensors, tail)
    with pytest.raises(CheckpointError, match=expected) as err:
        gguf_read.describe_gguf(path)
    assert "\n" not in str(err.value)
