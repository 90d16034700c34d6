"""The commit protocol on a real S3 server, without training: what readers list, gc's age rule, deletion order."""

from __future__ import annotations

import json

from automodel_ckpt.ondisk import catalog, layout
from automodel_ckpt.checkpoint.objectstore.run import open_run


def _run(seaweed, tmp_path, monkeypatch):
    for key, value in seaweed.env().items():
        monkeypatch.setenv(key, value)
    bucket = seaweed.new_bucket()
    return open_run(f"s3://{bucket}/run", None, tmp_path / "mirror"), seaweed.filesystem(), f"{bucket}/run"


def _checkpoint(fs, root: str, name: str, step: int, commit: bool) -> None:
    fs.pipe(f"{root}/{name}/{layout.UPLOAD_MARKER}", b"{}")  # a save's first object
    fs.pipe(f"{root}/{name}/model/shard.bin", b"x" * 100)
    fs.pipe(f"{root}/{name}/metadata.json", json.dumps({"step": step, "epoch": 0}).encode())
    if commit:
        files = {"model/shard.bin": {"size": 100, "checksum": "0"}}
        fs.pipe(f"{root}/{name}/{layout.MANIFEST_FILE}", json.dumps({"manifest_version": 1, "files": files}).encode())


def test_readers_list_only_committed_checkpoints_and_pointers_to_them(seaweed, tmp_path, monkeypatch):
    run, fs, root = _run(seaweed, tmp_path, monkeypatch)
    _checkpoint(fs, root, "epoch_0_step_2", 2, commit=True)
    _checkpoint(fs, root, "epoch_0_step_4", 4, commit=False)  # uploaded, never committed
    fs.pipe(f"{root}/LATEST", b"epoch_0_step_4\n")  # cannot happen (pointers follow commits); still ignored
    assert run.pull() == ["epoch_0_step_2"]
    assert [r.name for r in catalog.scan_checkpoints(run.mirror)] == ["epoch_0_step_2"]
    assert catalog.latest_checkpoint(run.mirror).name == "epoch_0_step_2"
    assert run.leftovers() == ["epoch_0_step_4"]
    # the mirror keeps only what lists a checkpoint; loading fetches the rest
    assert not (run.mirror / "epoch_0_step_2" / "model" / "shard.bin").exists()


def test_gc_spares_young_leftovers_and_never_touches_committed(seaweed, tmp_path, monkeypatch):
    run, fs, root = _run(seaweed, tmp_path, monkeypatch)
    _checkpoint(fs, root, "epoch_0_step_2", 2, commit=True)
    _checkpoint(fs, root, "epoch_0_step_4", 4, commit=False)
    assert run.gc(min_age_seconds=3600) == []  # written just now: may be an upload in progress
    assert run.leftovers() == ["epoch_0_step_4"]
    assert run.gc(min_age_seconds=0) == ["epoch_0_step_4"]
    assert run.leftovers() == [] and fs.exists(f"{root}/epoch_0_step_2/{layout.MANIFEST_FILE}")


def test_a_save_refuses_a_committed_name_and_clears_leftovers(seaweed, tmp_path, monkeypatch):
    import pytest

    from automodel_ckpt.errors import CheckpointError

    run, fs, root = _run(seaweed, tmp_path, monkeypatch)
    _checkpoint(fs, root, "epoch_0_step_2", 2, commit=True)
    _checkpoint(fs, root, "epoch_0_step_4", 4, commit=False)
    with pytest.raises(CheckpointError, match="already exists and is never overwritten"):
        run.before_save("epoch_0_step_2")
    assert run.before_save("epoch_0_step_4") == ["epoch_0_step_4"]
    # the killed upload is gone; the new save's upload marker is the first object of its prefix
    assert [i["name"].rsplit("/", 1)[-1] for i in run.store.objects("epoch_0_step_4")] == [layout.UPLOAD_MARKER]


def test_delete_removes_the_commit_object_first(seaweed, tmp_path, monkeypatch):
    run, fs, root = _run(seaweed, tmp_path, monkeypatch)
    _checkpoint(fs, root, "epoch_0_step_2", 2, commit=True)
    removed = []
    original = run.store.fs.rm_file

    def rm_file(path, *a, **k):
        removed.append(path)
        return original(path, *a, **k)

    monkeypatch.setattr(run.store.fs, "rm_file", rm_file)
    run.delete(["epoch_0_step_2"])
    assert removed[0].endswith(f"epoch_0_step_2/{layout.MANIFEST_FILE}")
    assert not run.store.objects("epoch_0_step_2") and run.pull() == []


def test_a_quarantined_checkpoint_is_never_listed_again(seaweed, tmp_path, monkeypatch):
    run, fs, root = _run(seaweed, tmp_path, monkeypatch)
    _checkpoint(fs, root, "epoch_0_step_2", 2, commit=True)
    _checkpoint(fs, root, "epoch_0_step_4", 4, commit=True)
    assert run.pull() == ["epoch_0_step_2", "epoch_0_step_4"]
    run.quarantine("epoch_0_step_4", "size mismatch")
    assert run.pull() == ["epoch_0_step_2"]
    assert json.loads(fs.cat(f"{root}/{layout.QUARANTINE_DIR}/epoch_0_step_4.json"))["reason"] == "size mismatch"
    assert run.leftovers() == [] and fs.exists(f"{root}/epoch_0_step_4/{layout.MANIFEST_FILE}")  # kept to inspect


def test_download_in_ranges_is_byte_exact_and_takes_objects_of_another_size_as_they_are(seaweed, tmp_path,
                                                                                         monkeypatch):
    import os

    from automodel_ckpt.checkpoint.objectstore import store as store_module

    run, fs, root = _run(seaweed, tmp_path, monkeypatch)
    monkeypatch.setattr(store_module, "RANGE", 1000)  # many ranges per file, fetched at once
    files = {"model/a.bin": os.urandom(10_500), "model/b.bin": os.urandom(999), "optim/c.bin": os.urandom(3000),
             "empty.txt": b""}
    for rel, data in files.items():
        fs.pipe(f"{root}/ck/{rel}", data)
    sizes = {rel: len(data) for rel, data in files.items()}
    run.store.download("ck", sorted(files), tmp_path / "one", sizes)
    assert {rel: (tmp_path / "one" / rel).read_bytes() for rel in files} == files
    assert sorted(p.name for p in (tmp_path / "one").rglob("*") if p.is_file()) == ["a.bin", "b.bin", "c.bin",
                                                                                   "empty.txt"]  # no temporaries
    # objects longer, shorter or other than the listed sizes arrive whole, as stored (the checks report them)
    changed = {"model/a.bin": files["model/a.bin"] + b"+", "model/b.bin": b"short", "optim/c.bin": b"x" * 500,
               "empty.txt": b"not empty"}  # c.bin: ranges past its end are refused by the store
    for rel, data in changed.items():
        fs.pipe(f"{root}/ck/{rel}", data)
    run.store.download("ck", sorted(files), tmp_path / "two", sizes)
    assert {rel: (tmp_path / "two" / rel).read_bytes() for rel in files} == files | changed
    run.store.download("ck", ["model/a.bin"], tmp_path / "three")  # sizes unknown: asked of the store
    assert (tmp_path / "three" / "model/a.bin").read_bytes() == changed["model/a.bin"]


def test_a_checkpoint_is_committed_only_after_the_logs_that_reach_its_step(seaweed, tmp_path, monkeypatch):
    """A job killed right after a commit object leaves a checkpoint a rerun resumes from: the store's
    ``training.jsonl`` already holds every step up to it (the rerun appends only the steps after it)."""
    run, fs, root = _run(seaweed, tmp_path, monkeypatch)
    run.pull()
    steps = "".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 5))
    (run.mirror / layout.TRAINING_LOG).write_text(steps, encoding="utf-8")
    staging = run.mirror / "staging"
    (staging / "model").mkdir(parents=True)
    (staging / "model" / "shard.bin").write_bytes(b"x" * 100)
    files = {"model/shard.bin": {"size": 100, "checksum": "0"}}
    (staging / layout.MANIFEST_FILE).write_text(json.dumps({"manifest_version": 1, "files": files}))
    run.upload_share(staging, "epoch_0_step_4", 0, 1)

    run.upload_commit_object(staging, "epoch_0_step_4")  # the job is killed right after: nothing else runs
    assert fs.exists(f"{root}/epoch_0_step_4/{layout.MANIFEST_FILE}")
    assert fs.cat(f"{root}/{layout.TRAINING_LOG}").decode() == steps


def test_the_mirror_keeps_log_lines_past_the_stores_copy_and_takes_a_copy_that_differs(seaweed, tmp_path,
                                                                                      monkeypatch):
    """The store's logs are pushed with durable checkpoints: the steps logged after (up to a node-local step)
    are only in the mirror, and a resume from that step needs them. Lines that do not continue the store's copy
    are another history: the store's copy replaces them."""
    run, fs, root = _run(seaweed, tmp_path, monkeypatch)
    run.pull()
    lines = [json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 8)]
    fs.pipe(f"{root}/{layout.TRAINING_LOG}", "".join(lines[:4]).encode())
    log = run.mirror / layout.TRAINING_LOG
    log.write_text("".join(lines), encoding="utf-8")  # steps 5 to 7 logged after the store's last push
    run.pull()
    assert log.read_text(encoding="utf-8") == "".join(lines)
    log.write_text("".join(lines[:2]) + json.dumps({"step": 3, "loss": 9.0}) + "\n", encoding="utf-8")
    run.pull()
    assert log.read_text(encoding="utf-8") == "".join(lines[:4])  # diverged: the store's
    log.write_text("".join(lines[:3]), encoding="utf-8")  # behind the store: the store's
    run.pull()
    assert log.read_text(encoding="utf-8") == "".join(lines[:4])
    fs.rm(f"{root}/{layout.TRAINING_LOG}")
    run.pull()  # nothing pushed yet (no durable checkpoint): the mirror's lines stay
    assert log.read_text(encoding="utf-8") == "".join(lines[:4])
