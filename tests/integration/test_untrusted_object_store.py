"""A bucket from elsewhere on a real S3 server (SeaweedFS): its manifests and listings never reach outside the mirror.

One small run (two torch_save checkpoints, written in-process) is uploaded once; each test tampers a server-side
copy. SeaweedFS refuses keys with ``..`` components (S3 itself accepts them): the bucket-side ``..`` cases are in
tests/unit/checkpoint/test_untrusted.py on an in-memory filesystem that keeps such keys; here the manifests name such paths
and the listings hold names SeaweedFS does accept (a control character).
"""

from __future__ import annotations

import json
import os
import tempfile
import uuid
from pathlib import Path

import pytest

from automodel_ckpt.ondisk import catalog, layout
from automodel_ckpt.checkpoint.checkpointer import SaveInfo
from automodel_ckpt.checkpoint.objectstore.run import open_run
from automodel_ckpt.cli import main as cli_main
from automodel_ckpt.distributed.env import init_distributed
from tests.unit.checkpoint.ckpt_state import State
from tests.unit.checkpoint.test_untrusted import checkpointer


@pytest.fixture(scope="module")
def uploaded(seaweed, tmp_path_factory):
    """``bucket/run`` holding checkpoints epoch_0_step_1 and epoch_0_step_2 (torch_save), LATEST on step 2."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in seaweed.env().items():
            mp.setenv(key, value)
        bucket = seaweed.new_bucket()
        ckpt = checkpointer(init_distributed(), f"s3://{bucket}/run", "torch_save",
                            staging_dir=str(tmp_path_factory.mktemp("upload") / "mirror"))
        state = State()
        for step in (1, 2):
            state.step()
            ckpt.save(state.states(), SaveInfo(epoch=0, step=step, train_loss=1.0, val_loss=None, is_final=False))
        ckpt.finalize()  # releases the run's lease: the copies below are other runs' folders
    return f"{bucket}/run"


@pytest.fixture
def run(seaweed, uploaded, tmp_path, monkeypatch):
    """A private copy of the uploaded run: ``(fs, root key, url)``; temporary folders of the verbs in tmp_path."""
    for key, value in seaweed.env().items():
        monkeypatch.setenv(key, value)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # a verb's fresh mirror: tmp_path/tmp/...
    fs = seaweed.filesystem()
    root = f"{uploaded}-{uuid.uuid4().hex[:8]}"
    fs.copy(uploaded, root, recursive=True)
    return fs, root, f"s3://{root}"


def cli(capsys, *args: object) -> tuple[int, str, str]:
    code = cli_main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_a_remote_manifest_naming_paths_outside_writes_nothing_outside_the_mirror(run, tmp_path, capsys):
    fs, root, url = run
    victim = tmp_path / "victim.txt"  # stands for ~/.bashrc
    victim.write_text("original\n")
    escaped = f"escaped-{uuid.uuid4().hex[:8]}"
    key = f"{root}/epoch_0_step_2/{layout.MANIFEST_FILE}"
    data = json.loads(fs.cat_file(key))
    data["files"][str(victim)] = {"size": 8, "checksum": "0"}
    data["files"][f"../../{escaped}/x"] = {"size": 5, "checksum": "0"}
    data["files"][f"model/../../../{escaped}/y"] = {"size": 5, "checksum": "0"}
    fs.pipe(f"{root}/epoch_0_step_2/{str(victim).lstrip('/')}", b"pwned!!\n")  # where the old key naming led
    fs.pipe(key, json.dumps(data).encode())

    for verb in (["verify", f"{url}/epoch_0_step_2"], ["consolidate", f"{url}/epoch_0_step_2", "--out",
                                                           tmp_path / "hf", "--no-progress"]):
        code, _, err = cli(capsys, *verb)
        assert code == 3, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and "names the unsafe path" in lines[0], err
    assert cli(capsys, "inspect", url)[0] == 0

    mirror = tmp_path / "mirror"  # a resume: the damaged newest checkpoint is set aside, the one before loads
    ckpt = checkpointer(init_distributed(), url, "torch_save", staging_dir=str(mirror))
    assert ckpt.resume(State(seed=5).states()).path == mirror / "epoch_0_step_1"
    ckpt.finalize()
    assert fs.exists(f"{root}/{layout.QUARANTINE_DIR}/{layout.quarantine_note('epoch_0_step_2')}")

    assert victim.read_text() == "original\n"
    assert not [p for p in tmp_path.rglob("*") if escaped in p.name]


def test_odd_prefix_names_and_pointers_from_the_bucket_are_never_checkpoints(run, tmp_path, capsys):
    fs, root, url = run
    odd = "step\t2"  # a control character: SeaweedFS stores it, the mirror never takes it for a checkpoint
    fs.copy(f"{root}/epoch_0_step_2", f"{root}/{odd}", recursive=True)
    assert f"{root}/{odd}" in fs.ls(root, refresh=True)
    remote = open_run(url, None, tmp_path / "mirror")
    assert remote.pull() == ["epoch_0_step_1", "epoch_0_step_2"]
    folders = sorted(p.name for p in remote.mirror.iterdir() if p.is_dir() and not p.is_symlink())
    assert folders == ["epoch_0_step_1", "epoch_0_step_2"]
    assert [r.name for r in catalog.scan_checkpoints(remote.mirror)] == ["epoch_0_step_1", "epoch_0_step_2"]

    fs.pipe(f"{root}/{layout.LATEST}", b"../../elsewhere\n")
    code, _, err = cli(capsys, "verify", f"{url}/{layout.LATEST}")
    assert code == 3 and err.strip() == (
        f"error: verify: the LATEST pointer in '{url}' names '../../elsewhere', which is not a checkpoint name (one "
        "plain path component); name a checkpoint instead")
    assert remote.pull() == ["epoch_0_step_1", "epoch_0_step_2"]
    assert catalog.pointer_target(remote.mirror, layout.LATEST) is None
    assert not (tmp_path / "elsewhere").exists() and not os.path.lexists(tmp_path / "mirror" / "elsewhere")
