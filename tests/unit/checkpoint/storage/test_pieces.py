"""The run's pieces on an object store (``objectstore.pieces``): reference records refused when hostile, counted
references, and a save / fetch / delete / collect cycle on fsspec's in-memory store (keys kept as S3 keeps them)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from automodel_ckpt.checkpoint.objectstore import pieces
from automodel_ckpt.checkpoint.objectstore.run import RemoteRun, fetch
from automodel_ckpt.checkpoint.objectstore.store import ObjectStore
from automodel_ckpt.errors import CheckpointError
from automodel_ckpt.ondisk import bounded, layout, manifest
from automodel_ckpt.ondisk.checksum import default_algorithm, hash_file
from automodel_ckpt.ondisk.incremental import Reuse, key_of

STABLE = f"{layout.MODEL_DIR}/{layout.model_shard_file(0, 2, 2)}"
TRAINED = f"{layout.MODEL_DIR}/{layout.model_shard_file(0, 1, 2)}"
KEY_A, KEY_B, KEY_C = "a" * 32, "b" * 32, "0123456789abcdef" * 2


def _record(files: dict) -> str:
    return json.dumps({"pieces_version": 1, "files": files})


# --- records and counting (no store) -------------------------------------------------------------------


def test_a_record_reads_back_what_was_written():
    refs = {STABLE: KEY_C, f"ref_model/{layout.model_shard_file(1, 2, 2)}": KEY_A}
    assert pieces.parse_record(pieces.record_text(refs), "'r'", listed=[*refs, TRAINED]) == refs


@pytest.mark.parametrize("key", ["../../epoch_0_step_1/model/x", "a" * 31 + "/", "..", "", "A" * 32, "a" * 31,
                                 "a" * 33, "g" * 32, "０" * 32, 7, None, ["a" * 32]])
def test_a_piece_key_is_32_lowercase_hex_digits_never_a_path(key):
    with pytest.raises(CheckpointError, match="not a piece key"):
        pieces.parse_record(_record({STABLE: key}), "'s3://b/run/c/pieces.json'")


@pytest.mark.parametrize("text,match", [
    (_record({"model/other.safetensors": KEY_A}), "does not list"),
    (json.dumps({"pieces_version": 2, "files": {}}), "this version reads"),
    (json.dumps({"files": {STABLE: KEY_A}}), "this version reads"),
    (json.dumps([1, 2]), "this version reads"),
    ("{" * 100 + "}" * 100, "nests"),
    ("not json", "not valid JSON"),
])
def test_a_damaged_or_hostile_record_is_one_line(text, match):
    with pytest.raises(CheckpointError, match=match) as err:
        pieces.parse_record(text, "'s3://b/run/c/pieces.json'", listed=[STABLE, TRAINED])
    assert "\n" not in str(err.value) and "s3://b/run/c/pieces.json" in str(err.value)


def test_a_record_over_the_manifest_limit_is_refused_before_it_is_parsed():
    with pytest.raises(CheckpointError, match="over the"):
        pieces.parse_record(b" " * (bounded.INDEX_FILE_LIMIT + 1), "'r'")


def test_a_piece_is_unreferenced_only_when_no_record_names_it():
    records = [{"m/x": KEY_A}, {"m/x": KEY_A, "r/x": KEY_B}, {}]
    assert pieces.unreferenced([KEY_A, KEY_B, KEY_C], records) == [KEY_C]
    assert pieces.unreferenced([KEY_A, KEY_B], records[:1]) == [KEY_B]
    assert pieces.unreferenced([KEY_A], []) == [KEY_A]


def test_shared_bytes_are_pieces_another_checkpoint_references_and_each_piece_is_stored_once():
    files = {"s1": {"m/stable": 100, "m/trained": 10}, "s2": {"m/stable": 100, "m/trained": 10},
             "s3": {"m/stable": 100, "m/trained": 10}, "old": {"m/stable": 100, "m/trained": 10}}
    records = {"s1": {"m/stable": KEY_A}, "s2": {"m/stable": KEY_A}, "s3": {"m/stable": KEY_B}}
    shares, stored = pieces.sharing(files, records)
    assert shares == {"s1": (10, 100), "s2": (10, 100), "s3": (110, 0), "old": (110, 0)}
    assert stored == 4 * 10 + 100 + 100 + 100  # trained files, pieces A and B once, the old checkpoint's own copy


# --- a run folder on the in-memory store -------------------------------------------------------------


@pytest.fixture
def store():
    bucket = f"b-{uuid.uuid4().hex[:10]}"
    store = ObjectStore(f"memory://{bucket}/run")
    yield store
    if store.fs.exists(bucket):
        store.fs.rm(bucket, recursive=True)


def _stage(staging: Path, reuse: Reuse, stable: bytes, trained: bytes) -> Path:
    """A sealed checkpoint folder: the stable shard written through ``reuse`` (its key known), the rest plainly."""
    reuse.begin()
    (staging / layout.MODEL_DIR).mkdir(parents=True)
    reuse.write(staging / STABLE, [stable], threads=1)
    (staging / TRAINED).write_bytes(trained)
    (staging / layout.METADATA_FILE).write_text(json.dumps({"step": 1, "epoch": 0}))
    files = manifest.list_files(staging)
    algorithm = default_algorithm()
    checksums = {rel: hash_file(staging / rel, algorithm)[1] for rel in files}
    manifest.write(staging, manifest.build_manifest(staging, files, checksums, algorithm))
    return staging


def _save(run: RemoteRun, staging: Path, name: str) -> dict:
    run.before_save(name)
    refs = run.upload_share(staging, name, 0, 1)
    run.upload_commit_object(staging, name, refs)
    return refs


def _fetched(store: ObjectStore, tmp: Path, name: str) -> Path:
    reader = RemoteRun(store, tmp / f"reader-{uuid.uuid4().hex[:6]}")
    assert name in reader.pull()
    fetch(reader.mirror / name, store.url, rank=0, world_size=1)
    return reader.mirror / name


def test_a_stable_file_is_uploaded_once_shared_by_reference_and_fetched_whole(store, tmp_path):
    run, reuse = RemoteRun(store, tmp_path / "mirror"), Reuse()
    stable = bytes(range(256)) * 40
    a = _stage(tmp_path / "a", reuse, stable, b"trained 1")
    refs_a = _save(run, a, "s1")
    key = refs_a[STABLE][0]
    assert refs_a == {STABLE: (key, False)} and pieces.KEY.fullmatch(key)
    assert store.fs.cat(pieces.piece_key(store, key)) == stable
    assert STABLE not in store.sizes("s1") and TRAINED in store.sizes("s1")  # the prefix holds no copy
    assert "linked_bytes" not in manifest.read_manifest(a)

    b = _stage(tmp_path / "b", reuse, stable, b"trained 2")
    assert _save(run, b, "s2") == {STABLE: (key, True)}  # found in the store: not uploaded again
    assert manifest.read_manifest(b)["linked_bytes"] == len(stable)  # what the cost report counts as not written
    assert list(pieces.present(store)) == [key]

    for name in ("s1", "s2"):  # every reader sees the folder as written
        folder = _fetched(store, tmp_path, name)
        assert (folder / STABLE).read_bytes() == stable and manifest.verify_manifest(folder).ok


def test_deleting_a_checkpoint_keeps_the_pieces_another_references_and_collects_orphans(store, tmp_path):
    run, reuse = RemoteRun(store, tmp_path / "mirror"), Reuse()
    _save(run, _stage(tmp_path / "a", reuse, b"frozen one" * 100, b"t1"), "s1")
    key_b = _save(run, _stage(tmp_path / "b", reuse, b"frozen two" * 100, b"t2"), "s2")[STABLE][0]
    key_c = _save(run, _stage(tmp_path / "c", reuse, b"frozen two" * 100, b"t3"), "s3")[STABLE][0]
    key_a = next(k for k in pieces.present(store) if k != key_b)
    assert key_b == key_c
    store.fs.pipe(f"{store.root}/{layout.PIECES_DIR}/README.txt", b"not a piece\n")  # never deleted
    run.delete(["s1", "s2"])
    assert sorted(pieces.present(store)) == [key_b]  # s1's piece went with it; s3 still references s2's
    store.fs.pipe(pieces.piece_key(store, key_a), b"an orphan")
    assert pieces.collect(store, store.prefixes(), min_age_seconds=3600) == []  # too young for gc
    assert pieces.collect(store, store.prefixes(), dry_run=True) == [key_a] and key_a in pieces.present(store)
    assert pieces.collect(store, store.prefixes()) == [key_a]
    assert sorted(pieces.present(store)) == [key_b]
    assert store.fs.cat(f"{store.root}/{layout.PIECES_DIR}/README.txt") == b"not a piece\n"
    assert manifest.verify_manifest(_fetched(store, tmp_path, "s3")).ok


def test_only_a_stable_file_this_process_wrote_and_left_unchanged_is_a_piece(store, tmp_path):
    reuse = Reuse()
    staging = _stage(tmp_path / "a", reuse, b"frozen" * 50, b"t")
    assert pieces.KEY.fullmatch(key_of(staging / STABLE)) and key_of(staging / TRAINED) is None
    (staging / STABLE).write_bytes(b"changed since")  # not the bytes its key was computed from
    assert key_of(staging / STABLE) is None
    assert pieces.put(store, staging, [STABLE, TRAINED], manifest.list_files(staging)) == {}  # uploaded whole
    staging = _stage(tmp_path / "b", reuse, b"frozen" * 50, b"t")
    reuse.begin()  # the next save: the last one's keys are forgotten
    assert key_of(staging / STABLE) is None


def test_a_missing_piece_is_one_line_naming_it(store, tmp_path):
    run = RemoteRun(store, tmp_path / "mirror")
    key = _save(run, _stage(tmp_path / "a", Reuse(), b"frozen" * 50, b"t"), "s1")[STABLE][0]
    store.fs.rm_file(pieces.piece_key(store, key))
    with pytest.raises(CheckpointError) as err:
        _fetched(store, tmp_path, "s1")
    text = str(err.value)
    assert "\n" not in text and f"{store.url}/{layout.PIECES_DIR}/{key}" in text and "missing" in text


def test_a_record_pointing_outside_the_pieces_is_refused_and_nothing_is_fetched(store, tmp_path):
    run = RemoteRun(store, tmp_path / "mirror")
    _save(run, _stage(tmp_path / "a", Reuse(), b"frozen" * 50, b"t"), "s1")
    store.fs.pipe(f"{store.root}/s1/{TRAINED}", b"secret")  # what a "../s1/..." key would reach
    store.fs.pipe(f"{store.root}/s1/{layout.PIECE_REFS}", _record({STABLE: f"../s1/{TRAINED}"}).encode())
    reader = RemoteRun(store, tmp_path / "reader")
    reader.pull()
    with pytest.raises(CheckpointError, match="not a piece key"):
        fetch(reader.mirror / "s1", store.url, rank=0, world_size=1)
    assert not (reader.mirror / "s1" / STABLE).exists()
    with pytest.raises(CheckpointError, match="not a piece key"):  # nor counted: collection stops, deletes nothing
        pieces.collect(store, store.prefixes())
