"""`restore_from` an archive (`ckpt-train pack`) reads the weights in place and trains as from the unpacked folder;
the same through an object store (SeaweedFS): `pack --out s3://...`, `verify` and `inspect` of the URL,
`restore_from: s3://.../model.tar`."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from automodel_ckpt.checkpoint.disk import layout
from tests.integration.harness import CKPT_TRAIN, ckpt_train, env_for, losses

STEPS = ("--step_scheduler.ckpt_every_steps", "2", "--step_scheduler.val_every_steps", "100")


def _first_loss(work: Path, assets: Path, name: str, restore_from: Path | str, env=None) -> float:
    ckpt_train(work, assets, *STEPS, "--checkpoint.checkpoint_dir", name, "--step_scheduler.max_steps", "1",
               "--checkpoint.restore_from", str(restore_from), "--checkpoint.load_only", "[model]", env=env)
    return losses(work / name)[0]


def _verb(assets: Path, *args: str, env=None) -> subprocess.CompletedProcess:
    done = subprocess.run([CKPT_TRAIN, *args], env=env_for(assets, env), capture_output=True, text=True, timeout=300)
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
    done = _verb(assets, "pack", str(work / "trained" / "epoch_0_step_2"), "--out", url, "--no-progress", env=env)
    assert f"archive written to {url}" in done.stdout
    assert "verify: OK" in _verb(assets, "verify", url, env=env).stdout
    assert "llama" in _verb(assets, "inspect", url, env=env).stdout.lower()
    assert _first_loss(work, assets, "from-s3", url, env=env) == from_folder
