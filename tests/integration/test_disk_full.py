"""A full disk (a real tmpfs): the save fails in one line on every rank, leaves nothing behind, a rerun resumes.

Each case trains 2 steps into a roomy tmpfs (checkpoint A), shrinks the tmpfs to half a checkpoint of free space,
trains 2 more steps (the save at step 4 hits ENOSPC), gives room back and reruns: it resumes from A and logs
steps 3 and 4 bitwise equal to the losses of the run that hit the full disk. Then ``ckpt-train consolidate``
runs out of room. Mounting needs root; without it the tests are skipped. The full-disk paths of every save
(both formats, async, metadata, manifest, EDQUOT, EROFS) are also covered in-process by
``tests/unit/ondisk/test_integrity.py``; the second case here (torch_save, async) is slow-marked for CI time.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from automodel_ckpt.ondisk import catalog, layout
from automodel_ckpt.ondisk import outofroom as diskfull
from automodel_ckpt.ondisk.durable import read_pointer
from automodel_ckpt.errors import DiskFullError
from tests.integration.harness import CKPT_TRAIN, ckpt_train, env_for, losses, run_command

ROOMY = 64 * 2**20
COMMON = ("--step_scheduler.ckpt_every_steps", "2", "--data.val_size", "64")
CASES = [
    pytest.param(("--checkpoint.model_save_format", "safetensors", "--checkpoint.save_consolidated", "every"),
                 id="safetensors-sync-export"),
    pytest.param(("--checkpoint.model_save_format", "torch_save", "--checkpoint.is_async", "true",
                  "--checkpoint.save_consolidated", "false"), id="torch_save-async", marks=pytest.mark.slow),
]


@contextlib.contextmanager
def mounted(folder: Path, size: int) -> Iterator[Path]:
    """A tmpfs of ``size`` bytes at ``folder`` while the block runs (the test skips where mounting needs root)."""
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], capture_output=True)


def _resize(folder: Path, size: int) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(folder)], check=True, capture_output=True)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("diskfull")


@pytest.fixture
def disk(tmp_path: Path):
    with mounted(tmp_path / "disk", ROOMY) as mnt:
        yield mnt


def _squeeze(mnt: Path, folder: Path, fraction: int = 2) -> None:
    """Leave about ``1/fraction`` of ``folder``'s size free on the tmpfs."""
    used = shutil.disk_usage(mnt).used
    _resize(mnt, used + diskfull.tree_bytes(folder) // fraction)


@pytest.mark.parametrize("case", CASES)
def test_full_disk_fails_in_one_line_and_rerun_resumes(work, assets, disk, case):
    args = (*COMMON, *case, "--checkpoint.checkpoint_dir", str(disk / "ckpt"))
    ckpt_train(work, assets, *args, "--step_scheduler.max_steps", "2", nproc=2)
    first = disk / "ckpt" / "epoch_0_step_2"
    assert catalog.latest_checkpoint(disk / "ckpt") == first
    before = sorted(p.relative_to(first).as_posix() for p in first.rglob("*"))

    _squeeze(disk, first)
    full = ckpt_train(work, assets, *args, "--step_scheduler.max_steps", "4", nproc=2, check=False)
    assert full.returncode == DiskFullError.exit_code, full.output[-3000:]
    errors = [line for line in full.output.splitlines() if "error:" in line and "no space left" in line]
    assert errors, full.output[-3000:]
    assert f"in '{disk / 'ckpt'}' failed: no space left on device (needs about" in errors[0]
    assert "free there" in errors[0] and "a rerun resumes from it" in errors[0]
    assert "Traceback" not in full.output
    computed = losses(disk / "ckpt")  # steps 1-2 of the first run, 3-4 of the run whose save failed
    assert len(computed) == 4
    leftovers = [p.name for p in (disk / "ckpt").iterdir() if layout.is_staging(p.name) or p.name.startswith(".")]
    assert leftovers == []
    assert read_pointer(disk / "ckpt", layout.LATEST) == first.name
    assert sorted(p.relative_to(first).as_posix() for p in first.rglob("*")) == before
    assert [r.name for r in catalog.scan_checkpoints(disk / "ckpt")] == [first.name]

    _resize(disk, ROOMY)
    rerun = ckpt_train(work, assets, *args, "--step_scheduler.max_steps", "4", nproc=2)
    assert f"Loading checkpoint from {first}" in rerun.output
    assert losses(disk / "ckpt") == computed
    assert read_pointer(disk / "ckpt", layout.LATEST) == "epoch_0_step_4"

    # `ckpt-train consolidate` out of room: one line, its temporary folder removed, nothing published
    export = disk / "export"
    _squeeze(disk, disk / "ckpt" / "epoch_0_step_4" / layout.MODEL_DIR, 8)  # bf16 export: half the fp32 shards
    done = run_command([CKPT_TRAIN, "consolidate", str(disk / "ckpt" / "epoch_0_step_4"), "--out", str(export)],
                       cwd=work, env=env_for(assets), timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == DiskFullError.exit_code, output
    lines = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in output, output
    assert lines[0].startswith(f"error: writing the Hugging Face export in '{disk}' failed: no space left on device")
    assert "needs about" in lines[0] and "free there" in lines[0]
    assert sorted(p.name for p in disk.iterdir()) == ["ckpt"]  # no export, no temporary folder


def test_an_inline_export_out_of_room_is_one_warning_and_the_checkpoint_is_saved_without_it(work, assets, disk):
    """Room for the checkpoint but not its Hugging Face export: the export is side work, the run goes on."""
    args = (*COMMON, "--checkpoint.model_save_format", "safetensors", "--checkpoint.checkpoint_dir", str(disk / "ckpt"))
    ckpt_train(work, assets, *args, "--checkpoint.save_consolidated", "false", "--step_scheduler.max_steps", "2",
               nproc=2)
    first = disk / "ckpt" / "epoch_0_step_2"
    # the next checkpoint fits (same size as the first), its export (bf16: half the fp32 shards) only half-way
    _resize(disk, shutil.disk_usage(disk).used + diskfull.tree_bytes(first) + diskfull.tree_bytes(first / "model") // 4)
    done = ckpt_train(work, assets, *args, "--checkpoint.save_consolidated", "every", "--step_scheduler.max_steps", "4",
                      nproc=2)
    second = disk / "ckpt" / "epoch_0_step_4"
    warned = [line for line in done.output.splitlines() if "is saved without its Hugging Face export" in line]
    assert len(warned) == 1 and "no space left on device" in warned[0], done.output[-3000:]
    assert "Traceback" not in done.output
    assert read_pointer(disk / "ckpt", layout.LATEST) == second.name
    assert [r.name for r in catalog.scan_checkpoints(disk / "ckpt")] == [first.name, second.name]
    assert not [p for p in (second / layout.MODEL_DIR).iterdir() if "consolidated" in p.name]  # nothing half-written
    events = [json.loads(line) for line in (disk / "ckpt" / layout.EVENTS_LOG).read_text().splitlines()]
    failures = [e for e in events if e["event"] == "side_failure"]
    assert [(e["kind"], e["at_step"]) for e in failures] == [("export", 4)]
    assert "1 side failure(s)" in done.output  # the end-of-run line

    verify = run_command([CKPT_TRAIN, "verify", str(second)], env=env_for(assets), timeout=300)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    listed = run_command([CKPT_TRAIN, "inspect", str(disk / "ckpt"), "--json"], env=env_for(assets), timeout=300)
    assert listed.returncode == 0, listed.stderr[-2000:]
    shown = {c["name"]: c["consolidated"] for c in json.loads(listed.stdout)["checkpoints"]}
    assert shown == {first.name: False, second.name: False}

    _resize(disk, ROOMY)  # its own script exports it later
    script = subprocess.run(["bash", str(second / layout.MODEL_DIR / layout.CONSOLIDATE_SCRIPT)], cwd=work,
                            env=env_for(assets), capture_output=True, text=True, timeout=300)
    assert script.returncode == 0, script.stdout + script.stderr
    assert (second / layout.MODEL_DIR / layout.CONSOLIDATED_DIR / layout.HF_CONFIG).is_file()
