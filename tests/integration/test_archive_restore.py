"""`restore_from` an archive (`ckpt-train pack`) reads the weights in place and trains as from the unpacked folder."""

from __future__ import annotations

import subprocess
from pathlib import Path

from automodel_ckpt.checkpoint.disk import layout
from tests.integration.harness import CKPT_TRAIN, ckpt_train, env_for, losses

STEPS = ("--step_scheduler.ckpt_every_steps", "2", "--step_scheduler.val_every_steps", "100")


def _first_loss(work: Path, assets: Path, name: str, restore_from: Path) -> float:
    ckpt_train(work, assets, *STEPS, "--checkpoint.checkpoint_dir", name, "--step_scheduler.max_steps", "1",
               "--checkpoint.restore_from", str(restore_from), "--checkpoint.load_only", "[model]")
    return losses(work / name)[0]


def test_restore_from_the_archive_gives_the_first_loss_of_the_unpacked_folder(tmp_path: Path, assets: Path) -> None:
    ckpt_train(tmp_path, assets, *STEPS, "--checkpoint.checkpoint_dir", "trained", "--step_scheduler.max_steps", "2")
    archive = tmp_path / "model.tar"
    done = subprocess.run([CKPT_TRAIN, "pack", str(tmp_path / "trained" / "epoch_0_step_2"), "--out", str(archive)],
                          env=env_for(assets), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "archive written to" in done.stdout, done.stderr[-2000:]
    folder = tmp_path / "unpacked"
    folder.mkdir()
    subprocess.run(["tar", "xf", str(archive), "-C", str(folder)], check=True, timeout=60)  # plain tar, no warning
    assert (folder / layout.HF_CONFIG).is_file() and (folder / layout.HF_INDEX).is_file()
    from_folder = _first_loss(tmp_path, assets, "from-folder", folder)
    from_archive = _first_loss(tmp_path, assets, "from-archive", archive)
    assert from_archive == from_folder
    assert from_folder != losses(tmp_path / "trained")[0]  # the trained weights, not the base's, were loaded
    assert sorted(p.name for p in tmp_path.iterdir()) == ["from-archive", "from-folder", "model.tar", "trained",
                                                          "unpacked"]  # nothing extracted beside the archive
