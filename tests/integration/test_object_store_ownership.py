"""On a real S3 server: a run deletes only what it wrote (upload markers, not "no manifest"), gc acts on a run folder
only, a staging_dir with other files is never cleaned, and one run at a time holds a run folder's lease."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from automodel_ckpt.ondisk import layout
from automodel_ckpt.checkpoint.objectstore.lease import Lease, me
from automodel_ckpt.checkpoint.objectstore.run import open_run
from automodel_ckpt.errors import CheckpointError, UserError

FOREIGN = {"datasets/x": b"team data", "models/y": b"team model", "notes.txt": b"hello"}


def _env(seaweed, monkeypatch) -> None:
    for key, value in seaweed.env().items():
        monkeypatch.setenv(key, value)


def _killed_upload(fs, root: str, name: str) -> None:
    """What a save killed during its upload leaves: its marker (always the first object) and some files."""
    fs.pipe(f"{root}/{name}/{layout.UPLOAD_MARKER}", b"{}")
    fs.pipe(f"{root}/{name}/model/shard.bin", b"x" * 100)


def _committed(fs, root: str, name: str) -> None:
    _killed_upload(fs, root, name)
    fs.pipe(f"{root}/{name}/{layout.MANIFEST_FILE}", json.dumps({"manifest_version": 1, "files": {}}).encode())


def _keys(fs, root: str) -> set[str]:
    return {p.removeprefix(root + "/") for p in fs.find(root)}


def _gc(*argv: str) -> str:
    """``ckpt-train gc`` in this process: what it prints (a ``UserError`` propagates, as the CLI reports it)."""
    import contextlib
    import io

    from automodel_ckpt.cli import gc

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert gc.main(list(argv)) == 0
    return out.getvalue()


def test_a_run_at_a_bucket_root_deletes_only_its_own_uploads(seaweed, tmp_path, monkeypatch):
    """checkpoint_dir: s3://bucket holding a team's datasets/ and models/: they survive the run's saves and gc;
    a killed upload (marker, no manifest) is still cleaned by the next save and by gc."""
    _env(seaweed, monkeypatch)
    bucket = seaweed.new_bucket()
    fs = seaweed.filesystem()
    for key, data in FOREIGN.items():
        fs.pipe(f"{bucket}/{key}", data)
    _killed_upload(fs, bucket, "epoch_0_step_2")
    run = open_run(f"s3://{bucket}", None, tmp_path / "mirror")
    run.prepare()
    try:
        assert run.leftovers() == ["epoch_0_step_2"]
        assert run.before_save("epoch_0_step_4") == ["epoch_0_step_2"]
        assert {k: fs.cat(f"{bucket}/{k}") for k in FOREIGN} == FOREIGN
        assert not fs.exists(f"{bucket}/epoch_0_step_2/model/shard.bin")
        # the save's first object is its marker; a save killed now is a leftover gc removes, the rest stays
        assert _keys(fs, f"{bucket}/epoch_0_step_4") == {layout.UPLOAD_MARKER}
        fs.pipe(f"{bucket}/epoch_0_step_4/model/shard.bin", b"y")
        printed = _gc(f"s3://{bucket}", "--min-age-minutes", "0")
        assert "gc: 1 leftover(s) deleted" in printed and "epoch_0_step_4" in printed
        assert {k: fs.cat(f"{bucket}/{k}") for k in FOREIGN} == FOREIGN
        assert not fs.exists(f"{bucket}/epoch_0_step_4/model/shard.bin")
        # a prefix this project did not write, named like the next checkpoint: the save is refused, nothing deleted
        with pytest.raises(CheckpointError, match="did not write") as refused:
            run.before_save("datasets")
        assert "\n" not in str(refused.value) and fs.cat(f"{bucket}/datasets/x") == FOREIGN["datasets/x"]
    finally:
        run.release()


def test_a_delete_removes_the_upload_marker_last(seaweed, tmp_path, monkeypatch):
    _env(seaweed, monkeypatch)
    bucket = seaweed.new_bucket()
    fs = seaweed.filesystem()
    _committed(fs, f"{bucket}/run", "epoch_0_step_2")
    run = open_run(f"s3://{bucket}/run", None, tmp_path / "mirror")
    calls: list[list[str]] = []
    for method in ("rm", "rm_file"):
        original = getattr(run.store.fs, method)

        def spy(path, *a, _original=original, **k):
            calls.append([path] if isinstance(path, str) else list(path))
            return _original(path, *a, **k)

        monkeypatch.setattr(run.store.fs, method, spy)
    run.delete(["epoch_0_step_2"])
    files = [p.rsplit("/", 1)[-1] for batch in calls for p in batch]
    assert files.index(layout.MANIFEST_FILE) < files.index("shard.bin") < files.index(layout.UPLOAD_MARKER)
    assert run.store.objects("epoch_0_step_2") == []


def test_gc_refuses_a_folder_that_is_not_a_run_folder_and_deletes_nothing(seaweed, tmp_path, monkeypatch):
    """``gc s3://bucket/runs`` (a parent of runs) is one line; the runs below it keep every object."""
    _env(seaweed, monkeypatch)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    bucket = seaweed.new_bucket()
    fs = seaweed.filesystem()
    for run_name in ("run1", "run2"):
        root = f"{bucket}/runs/{run_name}"
        fs.pipe(f"{root}/{layout.RUN_MARKER}", b"{}")
        _committed(fs, root, "epoch_0_step_2")
        _killed_upload(fs, root, "epoch_0_step_4")
    before = _keys(fs, bucket)
    with pytest.raises(UserError, match="is not a run folder") as refused:
        _gc(f"s3://{bucket}/runs", "--min-age-minutes", "0")
    assert "\n" not in str(refused.value)
    assert _keys(fs, bucket) == before
    # on a run folder it deletes that run's leftover only (and with --break-lease, a dead run's lease)
    fs.pipe(f"{bucket}/runs/run1/{layout.LEASE_OBJECT}", json.dumps(
        {"token": "t", "holder": {"host": "node-7", "pid": 41}, "since": 0, "renewed": 0, "expires": 0}).encode())
    printed = _gc(f"s3://{bucket}/runs/run1", "--min-age-minutes", "0", "--break-lease")
    assert "gc: 1 leftover(s) deleted" in printed and "(held by host node-7, pid 41)" in printed
    assert not fs.exists(f"{bucket}/runs/run1/{layout.LEASE_OBJECT}")
    assert before - _keys(fs, bucket) == {f"runs/run1/epoch_0_step_4/{f}"
                                          for f in (layout.UPLOAD_MARKER, "model/shard.bin")}


def test_a_staging_dir_holding_other_files_is_refused_and_other_folders_in_a_mirror_stay(seaweed, tmp_path,
                                                                                         monkeypatch):
    _env(seaweed, monkeypatch)
    bucket = seaweed.new_bucket()
    staging = tmp_path / "scratch"
    (staging / "experiments").mkdir(parents=True)
    (staging / "experiments" / "results.csv").write_text("a,b\n")
    run = open_run(f"s3://{bucket}/run", None, staging)
    with pytest.raises(CheckpointError, match="checkpoint.staging_dir: .* did not write") as refused:
        run.prepare()
    assert "\n" not in str(refused.value)
    assert (staging / "experiments" / "results.csv").read_text() == "a,b\n"
    assert not run.store.exists(layout.LEASE_OBJECT)  # refused before the lease was taken
    # a mirror of ours: a checkpoint deleted on the store goes, a folder someone put there stays
    mirror = tmp_path / "mirror"
    run = open_run(f"s3://{bucket}/run", None, mirror)
    run.pull()
    (mirror / "epoch_0_step_2").mkdir()
    (mirror / "epoch_0_step_2" / layout.METADATA_FILE).write_text("{}")
    (mirror / "mine").mkdir()
    (mirror / "mine" / "keep.txt").write_text("x")
    assert run.pull() == []
    assert not (mirror / "epoch_0_step_2").exists() and (mirror / "mine" / "keep.txt").read_text() == "x"


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


def test_the_lease_refuses_a_second_run_expires_and_is_released(seaweed, tmp_path, monkeypatch):
    _env(seaweed, monkeypatch)
    bucket = seaweed.new_bucket()
    url = f"s3://{bucket}/run"
    first = open_run(url, None, tmp_path / "m1")
    first.prepare()
    second = open_run(url, None, tmp_path / "m2")
    with pytest.raises(CheckpointError, match="is in use by another run") as refused:
        second.prepare()
    here = me()
    text = str(refused.value)
    assert "\n" not in text and f"host {here['host']}, pid {here['pid']}, since " in text and "--break-lease" in text
    assert not (tmp_path / "m2" / layout.OBJECT_STORE_SOURCE).exists()  # refused before touching anything
    first.release()  # a clean exit removes the lease: the next run starts at once
    assert not seaweed.filesystem().exists(f"{bucket}/run/{layout.LEASE_OBJECT}")
    second.prepare()
    second.release()

    # an injected clock: a lease not renewed for its expiry is taken over; its old holder then saves nothing
    clock = Clock()
    store = open_run(url, None, tmp_path / "m3").store
    old, new = Lease(store, clock=clock, expiry=60), Lease(store, clock=clock, expiry=60)
    old.acquire()
    clock.t += 59
    with pytest.raises(CheckpointError, match="expires in 1 s"):
        new.acquire()
    assert old.renew()  # a heartbeat: good for another 60 s
    clock.t += 59
    with pytest.raises(CheckpointError, match="last heartbeat 59 s ago"):
        new.acquire()
    clock.t += 2
    new.acquire()
    assert not old.renew() and old.lost is not None
    with pytest.raises(CheckpointError, match="lost the lease"):
        old.check()
    old.release()  # not ours any more: left in place
    assert store.exists(layout.LEASE_OBJECT)
    new.release()
    assert not store.exists(layout.LEASE_OBJECT)


def test_a_lease_whose_holder_died_on_this_machine_is_taken_at_once_and_the_heartbeat_renews(seaweed, tmp_path,
                                                                                               monkeypatch):
    _env(seaweed, monkeypatch)
    bucket = seaweed.new_bucket()
    run = open_run(f"s3://{bucket}/run", None, tmp_path / "m")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    holder = {**me(), "pid": int(dead.stdout), "pid_start": "1"}
    lease = {"token": "killed-run", "holder": holder, "since": time.time(), "renewed": time.time(),
             "expires": time.time() + 3600}
    run.store.write_text(json.dumps(lease), layout.LEASE_OBJECT)
    run.prepare(lease=Lease(run.store, heartbeat=0.05))
    try:
        first = json.loads(run.store.read_text(layout.LEASE_OBJECT))
        assert first["holder"]["pid"] == me()["pid"]
        deadline = time.monotonic() + 30
        while json.loads(run.store.read_text(layout.LEASE_OBJECT))["renewed"] == first["renewed"]:
            assert time.monotonic() < deadline, "the heartbeat never renewed the lease"
    finally:
        run.release()
    assert not run.store.exists(layout.LEASE_OBJECT)


def test_a_training_run_at_a_bucket_root_keeps_foreign_objects_and_a_live_lease_refuses_the_next(seaweed, assets,
                                                                                                   tmp_path):
    """Two short ``ckpt-train`` runs on ``s3://bucket`` (a team's datasets/ and models/ there): the first saves,
    removes a killed upload, keeps every foreign object and releases its lease at exit; the second meets a lease
    held by a live process and stops before training, in one line naming the holder."""
    from tests.integration.harness import ckpt_train

    bucket = seaweed.new_bucket()
    fs, env = seaweed.filesystem(), seaweed.env(XDG_CACHE_HOME=str(tmp_path / "cache"))
    for key, data in FOREIGN.items():
        fs.pipe(f"{bucket}/{key}", data)
    _killed_upload(fs, bucket, "epoch_0_step_9")
    args = ("--checkpoint.checkpoint_dir", f"s3://{bucket}", "--checkpoint.staging_dir", str(tmp_path / "stage"),
            "--step_scheduler.max_steps", "2", "--step_scheduler.ckpt_every_steps", "2",
            "--checkpoint.save_consolidated", "false", "--data.val_size", "64")
    ckpt_train(tmp_path, assets, *args, env=env)
    assert {k: fs.cat(f"{bucket}/{k}") for k in FOREIGN} == FOREIGN
    assert fs.exists(f"{bucket}/epoch_0_step_2/{layout.MANIFEST_FILE}")
    assert not fs.exists(f"{bucket}/epoch_0_step_9/model/shard.bin")
    assert fs.exists(f"{bucket}/{layout.RUN_MARKER}") and not fs.exists(f"{bucket}/{layout.LEASE_OBJECT}")

    holder = me()  # this test process: alive, on this machine
    now = time.time()
    fs.pipe(f"{bucket}/{layout.LEASE_OBJECT}", json.dumps(
        {"token": "live", "holder": holder, "since": now, "renewed": now, "expires": now + 600}).encode())
    result = ckpt_train(tmp_path, assets, *args, "--step_scheduler.max_steps", "4", env=env, check=False)
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and len(errors) == 1, result.output[-2000:]
    assert "is in use by another run" in errors[0] and f"pid {holder['pid']}" in errors[0]
    assert "Traceback" not in result.output and not fs.exists(f"{bucket}/epoch_0_step_4")
    assert json.loads(fs.cat(f"{bucket}/{layout.LEASE_OBJECT}"))["token"] == "live"  # the holder's, untouched
