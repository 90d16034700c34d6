"""Node-local transfer streams, run against each other in one process: files arrive whole, in bounded chunks, and
what a sender names is checked before a byte is written (plain names, no link on the way, manifest sizes and
checksums)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from automodel_ckpt.ondisk.checksum import default_algorithm, hash_file
from automodel_ckpt.checkpoint.storage.nodelocal.transfer import receive_stream, send_stream

FILES = {"metadata.json": b"{}", "model/shard.safetensors": bytes(range(256)) * 3, "optim/empty": b"",
         "rng/rng_dp_rank_1.pt": b"0123456789"}


def pump(send: Any, receive: Any, largest: list[int] | None = None) -> dict[str, list[str]]:
    """Run a send stream and a receive stream to their ends, message by message, as two ranks would."""
    done: dict[str, list[str]] = {}
    while True:
        out = into = None
        try:
            out = next(send)
        except StopIteration as end:
            done["send"] = end.value
        try:
            into = next(receive)
        except StopIteration as end:
            done["receive"] = end.value
        if out is None and into is None:
            return done
        assert out is not None and into is not None and out.shape == into.shape and out.dtype == into.dtype
        if largest is not None:
            largest.append(out.numel())
        into.copy_(out)


def make(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def manifest_of(root: Path, files: dict[str, bytes]) -> dict[str, Any]:
    algorithm = default_algorithm()
    return {"checksum_algorithm": algorithm,
            "files": {rel: {"size": len(d), "checksum": hash_file(root / rel, algorithm)[1]} for rel, d in files.items()}}


def hostile(files: list[tuple[str, bytes]], error: str | None = None) -> Any:
    """A sender that names whatever it likes."""
    header = json.dumps({"files": [[rel, len(data)] for rel, data in files], "error": error}).encode()
    yield torch.tensor([len(header)], dtype=torch.int64)
    yield torch.frombuffer(bytearray(header), dtype=torch.uint8)
    for _, data in files:
        if data:
            yield torch.frombuffer(bytearray(data), dtype=torch.uint8)
    trailer = b'{"problems": []}'
    yield torch.tensor([len(trailer)], dtype=torch.int64)
    yield torch.frombuffer(bytearray(trailer), dtype=torch.uint8)
    return []


def test_files_arrive_whole_in_chunks_no_larger_than_asked(tmp_path):
    src = make(tmp_path / "src", FILES)
    got: list[str] = []
    sizes: list[int] = []
    done = pump(send_stream(0, 1, list(FILES), src, chunk_bytes=100),
                receive_stream(0, tmp_path / "dst" / "epoch_0_step_2", manifest_of(src, FILES), 100, got), sizes)
    assert done == {"send": [], "receive": []} and got == list(FILES)
    for rel, data in FILES.items():
        assert (tmp_path / "dst" / "epoch_0_step_2" / rel).read_bytes() == data
    assert max(sizes[2:-2]) == 100 and len([s for s in sizes if s == 100]) == 7  # 768 bytes: 7 full chunks + 68
    leftovers = [p.name for p in (tmp_path / "dst").rglob("*") if ".recv-" in p.name]
    assert leftovers == []
    assert os.stat(tmp_path / "dst" / "epoch_0_step_2" / "model").st_mode & 0o777 == 0o700


def test_unsafe_names_are_refused_their_bytes_dropped_and_the_rest_received(tmp_path):
    dst = tmp_path / "node" / "step"
    got: list[str] = []
    done = pump(hostile([("../evil", b"bad"), ("/abs", b"bad"), ("ok/file", b"fine"), ("ok/file", b"again")]),
                receive_stream(0, dst, None, received=got))
    assert got == ["ok/file"] and (dst / "ok" / "file").read_bytes() == b"fine"
    assert not (tmp_path / "node" / "evil").exists() and not Path("/abs").exists()
    problems = done["receive"]
    assert len(problems) == 3
    assert "names the unsafe path '../evil' (a '..' component)" in problems[0]
    assert "names the unsafe path '/abs' (absolute)" in problems[1]
    assert "'ok/file' is sent twice" in problems[2]


def test_no_symlink_on_the_way_is_followed(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    dst = tmp_path / "dst"
    dst.mkdir()
    os.symlink(outside, dst / "model")  # a folder on the way is a link
    os.symlink(outside / "target", dst / "config.yaml")  # the file's own name is a link leading out
    (dst / "other").write_bytes(b"o")
    os.symlink("other", dst / "metadata.json")  # ... or one inside: replaced, never written through
    done = pump(hostile([("model/x", b"12"), ("config.yaml", b"c"), ("metadata.json", b"{}")]),
                receive_stream(3, dst))
    assert os.listdir(outside) == [] and (dst / "config.yaml").is_symlink()
    assert not (dst / "metadata.json").is_symlink() and (dst / "metadata.json").read_bytes() == b"{}"
    assert (dst / "other").read_bytes() == b"o"
    assert len(done["receive"]) == 2
    assert "names the unsafe path 'model/x' (it leads out of" in done["receive"][0]
    assert "'config.yaml' (it leads out of" in done["receive"][1]


def test_files_that_do_not_match_the_manifest_are_refused(tmp_path):
    src = make(tmp_path / "src", FILES)
    expected = manifest_of(src, FILES)
    (src / "rng/rng_dp_rank_1.pt").write_bytes(b"9123456789")  # same size, other bytes
    (src / "metadata.json").write_bytes(b"{ }")  # another size
    dst = tmp_path / "dst"
    done = pump(send_stream(0, 1, list(FILES), src), receive_stream(0, dst, expected))
    assert sorted(os.listdir(dst)) == ["model", "optim", "rng"]
    assert os.listdir(dst / "rng") == []  # neither the file nor its temporary survives
    problems = done["receive"]
    assert "'metadata.json' is 3 bytes, its manifest says 2" in problems[0]
    assert "'rng/rng_dp_rank_1.pt' does not match its manifest's checksum" in problems[1]


def test_a_sender_that_cannot_send_says_so_and_the_stream_still_ends(tmp_path):
    src = make(tmp_path / "src", FILES)
    os.symlink(src / "metadata.json", src / "link.json")
    for rels, why in ((["metadata.json", "../x"], "unsafe path '../x'"), (["missing"], "No such file"),
                      (["link.json"], "a symlink, not a regular file")):
        done = pump(send_stream(2, 5, rels, src), receive_stream(2, tmp_path / "dst"))
        assert done["send"] == done["receive"] and len(done["send"]) == 1
        assert done["send"][0].startswith("rank 2 could not send to rank 5: ") and why in done["send"][0]
    assert not (tmp_path / "dst" / "metadata.json").exists()  # nothing of a refused list is sent


def test_a_file_that_shrinks_while_sent_is_reported_on_both_ends(tmp_path):
    src = make(tmp_path / "src", {"a": b"x" * 50})
    send = send_stream(0, 1, ["a"], src, chunk_bytes=20)
    receive = receive_stream(0, tmp_path / "dst", None, 20)
    for _ in range(2):  # the header's length and the header: the sender has opened the file
        next(receive).copy_(next(send))
    os.truncate(src / "a", 10)
    done = pump(send, receive)
    assert done["send"] == done["receive"] and "shrank while it was sent to rank 1" in done["send"][0]
