"""Node-local folders: where, private (mode 0700, this user's, no link), bound to one run, room, removal; and the
`checkpoint.local:` section."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from automodel_ckpt.checkpoint.config import CheckpointConfig, LocalTierConfig
from automodel_ckpt.checkpoint.storage.nodelocal.localdir import (check_private, check_space, claim, default_folder,
                                                                  read_binding, remove, run_id)
from automodel_ckpt.checkpoint.storage.nodelocal import localdir
from automodel_ckpt.errors import CheckpointError, ConfigError

FP = {"model": "tiny", "params": [["w", [4, 4]]]}


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_the_default_folder_is_per_user_and_per_run_location(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    here = default_folder("runs/a")
    assert here.parent == Path("/dev/shm") / f"automodel-ckpt-{localdir._user()}"
    assert here == default_folder(str(tmp_path / "runs" / "a")) == default_folder(str(tmp_path / "runs/a/"))
    assert default_folder("runs/b") != here  # another run folder, another node-local folder
    assert run_id("s3://bucket/run") == run_id("s3://bucket/run/") != run_id("s3://bucket/other")
    assert len(run_id("runs/a")) == 16 and default_folder("x", base=tmp_path).parent.parent == tmp_path


def test_claim_makes_private_folders_and_binds_them(tmp_path):
    folder = tmp_path / "shm" / "automodel-ckpt-me" / "run1"
    (tmp_path / "shm").mkdir()
    assert claim(folder, "run1", FP, private_parent=True) == []
    assert mode(folder) == mode(folder.parent) == 0o700
    assert read_binding(folder) == {"run_id": "run1", "fingerprint": localdir.fingerprint_digest(FP)}
    assert claim(folder, "run1", FP, private_parent=True) == []  # a rerun of the same run: reused as it is


def test_a_folder_open_to_others_a_link_or_another_users_is_refused(tmp_path, monkeypatch):
    open_folder = tmp_path / "open"
    open_folder.mkdir(mode=0o700)
    os.chmod(open_folder, 0o755)
    with pytest.raises(CheckpointError, match=r"can be read or written by other users \(mode 0755\); run `chmod 700"):
        claim(open_folder, "r", FP)
    os.chmod(open_folder, 0o711)  # others may enter, not list or write: private enough
    check_private(open_folder)
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    os.symlink(real, tmp_path / "link")
    with pytest.raises(CheckpointError, match="is a symlink; a node-local folder is never reached through a link"):
        claim(tmp_path / "link", "r", FP)
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="cannot use .*file': not a folder"):
        check_private(tmp_path / "file")
    monkeypatch.setattr(localdir.os, "geteuid", lambda: os.stat(real).st_uid + 1)  # as if another user made it
    with pytest.raises(CheckpointError, match=r"belongs to uid \d+, not to this user"):
        claim(real, "r", FP)


def test_the_per_user_parent_is_checked_too(tmp_path):
    parent = tmp_path / "automodel-ckpt-me"
    parent.mkdir()
    os.chmod(parent, 0o777)  # made by someone else, open to all: never used
    with pytest.raises(CheckpointError, match="automodel-ckpt-me' can be read or written by other users"):
        claim(parent / "run", "r", FP, private_parent=True)
    assert not (parent / "run").exists()


def test_another_runs_folder_is_never_used_and_a_foreign_folder_never_taken(tmp_path):
    folder = tmp_path / "local"
    claim(folder, "run1", FP)
    with pytest.raises(CheckpointError, match="holds the node-local steps of another run .*run id run1, this run's "
                                              "is run2"):
        claim(folder, "run2", FP)
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    (home / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="is not empty and holds no .automodel-ckpt-local.json .*'notes.txt'"):
        claim(home, "run1", FP)
    (folder / ".automodel-ckpt-local.json").write_text("[1]")
    with pytest.raises(CheckpointError, match="automodel-ckpt-local.json' is malformed; remove the folder"):
        claim(folder, "run1", FP)


def test_a_changed_recipe_empties_the_folder_with_a_warning(tmp_path):
    folder = tmp_path / "local"
    claim(folder, "run1", FP)
    for name in ("epoch_0_step_2", ".staging-epoch_0_step_4"):
        (folder / name / "model").mkdir(parents=True)
        (folder / name / "model" / "x").write_bytes(b"1")
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "keep").write_text("k")
    os.symlink(outside, folder / "epoch_0_step_6")  # a link in a step's name: removed, never followed
    warnings = claim(folder, "run1", {**FP, "model": "other"})
    assert len(warnings) == 1 and "the recipe changed" in warnings[0] and "3 node-local steps were removed" in warnings[0]
    assert sorted(os.listdir(folder)) == [".automodel-ckpt-local.json"] and (outside / "keep").exists()
    assert json.loads((folder / ".automodel-ckpt-local.json").read_text())["fingerprint"] == \
        localdir.fingerprint_digest({**FP, "model": "other"})
    assert claim(folder, "run1", {**FP, "model": "other"}) == []


def test_check_space_says_the_numbers(tmp_path, monkeypatch):
    monkeypatch.setattr(localdir.shutil, "disk_usage", lambda _: _Usage(3 << 30))
    check_space(tmp_path, step_bytes=1 << 30, keep=0, copies=0)  # (0 + 1) * 1 GiB * (1 + 0) fits in 3 GiB
    check_space(tmp_path, step_bytes=(3 << 30) // 4, keep=1, copies=1)  # exactly 3 GiB: fits
    with pytest.raises(CheckpointError) as err:
        check_space(tmp_path, step_bytes=1 << 30, keep=1, copies=1)  # (1 + 1) * 1 GiB * (1 + 1) = 4 GiB > 3 GiB
    text = str(err.value)
    assert "\n" not in text and "has 3.0 GiB free" in text and "need 4.0 GiB" in text
    assert "2 node-local steps (1 kept and one being written) of 1.0 GiB with 1 copies each" in text


class _Usage:
    def __init__(self, free: int) -> None:
        self.free = free


def test_remove_takes_only_what_the_run_wrote(tmp_path):
    folder = tmp_path / "local"
    claim(folder, "run1", FP)
    (folder / "epoch_0_step_2").mkdir()
    (folder / "epoch_0_step_2" / "f").write_bytes(b"1")
    assert remove(folder, "run2") is False and (folder / "epoch_0_step_2").exists()  # another run's: untouched
    assert remove(folder, "run1") is True and not folder.exists()
    claim(folder, "run1", FP)
    (folder / "user-file").write_text("u")
    assert remove(folder, "run1") is False and sorted(os.listdir(folder)) == ["user-file"]
    assert remove(tmp_path / "missing", "run1") is False


def test_the_local_section_is_validated_on_creation():
    assert CheckpointConfig().local == LocalTierConfig(every_steps=0, dir=None, replicas=1, keep=1)
    assert CheckpointConfig(local=LocalTierConfig(every_steps=2, dir="/nvme/ckpt", replicas=0)).local.every_steps == 2
    for kwargs, message in (({"every_steps": -1}, "checkpoint.local.every_steps: expected a whole number >= 0"),
                            ({"keep": 0}, "checkpoint.local.keep: expected a whole number >= 1, got 0"),
                            ({"replicas": True}, "checkpoint.local.replicas: expected a whole number >= 0, got True"),
                            ({"dir": " "}, "checkpoint.local.dir: must not be empty"),
                            ({"dir": "s3://b/run"}, "checkpoint.local.dir: expected a folder on each node")):
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
            LocalTierConfig(**kwargs)


def test_the_local_section_comes_from_yaml_and_overrides():
    from automodel_ckpt.config.loader import load_config
    from automodel_ckpt.config.schema import RecipeConfig
    from automodel_ckpt.config.validate import validate_config

    recipe = str(Path(__file__).resolve().parents[5] / "recipes" / "tiny_llama_sft.yaml")
    cfg = load_config(recipe, ["--checkpoint.local.every_steps", "2", "--checkpoint.local.dir", "/nvme/a"],
                      RecipeConfig)
    validate_config(cfg, 1)
    local = CheckpointConfig.from_section(cfg.checkpoint).local
    assert local == LocalTierConfig(every_steps=2, dir="/nvme/a", replicas=1, keep=1)
    cfg = load_config(recipe, ["--checkpoint.local.keep", "0"], RecipeConfig)
    with pytest.raises(ConfigError, match="checkpoint.local.keep: expected a whole number >= 1"):
        validate_config(cfg, 1)
