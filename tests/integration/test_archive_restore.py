"""`restore_from` an archive (`ckpt-train pack`) reads the weights in place and trains as from the unpacked folder;
the same through an object store (SeaweedFS): `pack --out s3://...`, `verify` and `inspect` of the URL,
`restore_from: s3://.../model.tar`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from automodel_ckpt.ondisk import layout
from tests.integration.harness import CKPT_TRAIN, ckpt_train, env_for, losses, run_command

# `ckpt-train` that stops at the first file or folder it creates in TMPDIR: `pack --out s3://` stages nothing
_NOTHING_CREATED_IN_TMPDIR = """
import os, sys, tempfile
tmp = os.path.realpath(tempfile.gettempdir())  # found (and probed) before the watch starts
def watch(event, args):
    if event in ("open", "os.mkdir") and isinstance(args[0], str) and os.path.realpath(args[0]).startswith(tmp):
        raise RuntimeError(f"staged in TMPDIR: {event} {args[0]}")
sys.addaudithook(watch)
from automodel_ckpt.cli import main
sys.exit(main())
"""
STEPS = ("--step_scheduler.ckpt_every_steps", "2", "--step_scheduler.val_every_steps", "100", "--data.val_size", "64")


def _first_loss(work: Path, assets: Path, name: str, restore_from: Path | str, env=None) -> float:
    ckpt_train(work, assets, *STEPS, "--checkpoint.checkpoint_dir", name, "--step_scheduler.max_steps", "1",
               "--checkpoint.restore_from", str(restore_from), "--checkpoint.load_only", "[model]", env=env)
    return losses(work / name)[0]


def _verb(assets: Path, *args: str, env=None) -> subprocess.CompletedProcess:
    done = run_command([CKPT_TRAIN, *args], env=env_for(assets, env), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, assets: Path) -> tuple[Path, float]:
    """Two steps trained; their checkpoint packed, unpacked with plain tar, and its first loss restored from there."""
    work = tmp_path_factory.mktemp("archive")
    ckpt_train(work, assets, *STEPS, "--checkpoint.checkpoint_dir", "trained", "--step_scheduler.max_steps", "2")
    done = _verb(assets, "pack", str(work / "trained" / "epoch_0_step_2"), "--out", str(work / "model.tar"))
    assert "archive written to" in done.stdout
    folder = work / "unpacked"
    folder.mkdir()
    subprocess.run(["tar", "xf", str(work / "model.tar"), "-C", str(folder)], check=True, timeout=60)  # no warning
    assert (folder / layout.HF_CONFIG).is_file() and (folder / layout.HF_INDEX).is_file()
    return work, _first_loss(work, assets, "from-folder", folder)


def test_restore_from_the_archive_gives_the_first_loss_of_the_unpacked_folder(trained, assets: Path) -> None:
    work, from_folder = trained
    from_archive = _first_loss(work, assets, "from-archive", work / "model.tar")
    assert from_archive == from_folder
    assert from_folder != losses(work / "trained")[0]  # the trained weights, not the base's, were loaded
    assert sorted(p.name for p in work.iterdir()) == ["from-archive", "from-folder", "model.tar", "trained",
                                                      "unpacked"]  # nothing extracted beside the archive


def test_an_archive_round_trips_through_an_object_store(trained, assets: Path, seaweed) -> None:
    work, from_folder = trained
    env = seaweed.env()
    url = f"s3://{seaweed.new_bucket()}/models/model.tar"
    tmp = work / "empty-tmp"
    tmp.mkdir()
    done = subprocess.run([sys.executable, "-c", _NOTHING_CREATED_IN_TMPDIR, "pack",
                           str(work / "trained" / "epoch_0_step_2"), "--out", url, "--no-progress"],
                          env=env_for(assets, {**env, "TMPDIR": str(tmp)}), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and f"archive written to {url}" in done.stdout, done.stderr[-2000:]
    assert not any(tmp.iterdir())
    assert "verify: OK" in _verb(assets, "verify", url, env=env).stdout
    assert "llama" in _verb(assets, "inspect", url, env=env).stdout.lower()
    assert _first_loss(work, assets, "from-s3", url, env=env) == from_folder


def test_a_pack_that_fails_half_way_leaves_nothing_at_the_url(seaweed, tmp_path, monkeypatch) -> None:
    """Parts are already uploaded when a member fails to read: the multipart upload is aborted, no object shows."""
    from automodel_ckpt.checkpoint import objectstore, storage
    from automodel_ckpt.export import archive_pack
    from automodel_ckpt.export.archive_pack import pack_into
    from automodel_ckpt.errors import CheckpointError

    folder = tmp_path / "export"
    folder.mkdir()
    (folder / layout.HF_CONFIG).write_text("{}")
    (folder / "model-00001-of-00002.safetensors").write_bytes(b"1" * (20 << 20))  # copied in chunks of 8 MiB
    (folder / "model-00002-of-00002.safetensors").write_bytes(b"2" * (1 << 20))
    for key, value in seaweed.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(objectstore, "PART_SIZE", 5 << 20)  # the store's smallest: a part per chunk, and the
    # first part is uploaded before the third is made, where the second shard fails
    bucket = seaweed.new_bucket()
    url = f"s3://{bucket}/models/model.tar"
    fs = seaweed.filesystem()
    uploading = []
    open_regular = archive_pack.open_regular  # the face's, as the packer reads each member

    def failing_second_shard(path, **kw):
        if path.name.startswith("model-00002"):
            uploading.extend(fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", []))
            raise OSError(5, "Input/output error", str(path))
        return open_regular(path, **kw)

    monkeypatch.setattr(archive_pack, "open_regular", failing_second_shard)
    with pytest.raises(CheckpointError, match="model-00002.*nothing was stored"):
        pack_into(folder, lambda size: storage.streamed_object(url, size, key="--out"), progress=False)
    assert uploading  # the first shard's parts were on their way when the second failed
    assert not fs.exists(url) and not fs.find(bucket)
    assert not fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads")  # aborted, no parts kept
