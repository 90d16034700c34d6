"""No link is followed out of a folder we read or write, and only regular files are opened.

Each case puts a symlink (to a file or folder outside, holding a secret) or a FIFO where a file or folder of ours
or of a received checkpoint goes, and checks the outcome: one line naming the path and what it is, the file outside
neither read, written, truncated nor deleted, and nothing blocks. A FIFO that a regression would wait on forever
trips ``no_hang``'s alarm instead.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest

from automodel_ckpt.ondisk import catalog, durable, layout, manifest, paths
from automodel_ckpt.ondisk.quarantine import quarantine
from automodel_ckpt.export.hf_metadata import read_hf_metadata
from automodel_ckpt.checkpoint.storage.lifecycle import discard_staging, prune, reserve
from automodel_ckpt.ondisk.retention import RetentionPolicy
from automodel_ckpt.checkpoint.storage.runlock import RunLock
from automodel_ckpt.errors import CheckpointError, UserError
from automodel_ckpt.training.metrics import JsonlLog, read_jsonl
from tests.unit.checkpoint.test_untrusted import cli, copy_run, env, one_error_line, templates  # noqa: F401 - fixtures

SECRET = "secret: not ours\n"


@pytest.fixture
def no_hang():
    """Fail (instead of hanging) if the test blocks, as a reader of a FIFO would."""
    def expired(*_):
        raise TimeoutError("blocked: a FIFO was opened and waited on")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(30)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def outside(tmp_path) -> Path:
    """A folder outside the run folder holding a secret file."""
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "secret.txt").write_text(SECRET)
    return folder


def untouched(outside: Path) -> bool:
    return sorted(p.name for p in outside.iterdir()) == ["secret.txt"] and (outside / "secret.txt").read_text() == SECRET


# --- the run lock ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["symlink", "fifo", "dangling symlink"])
def test_a_lock_file_that_is_no_regular_file_is_refused_and_never_written_through(tmp_path, outside, no_hang, kind):
    run = tmp_path / "run"
    run.mkdir()
    lock_path = run / layout.RUN_LOCK
    if kind == "fifo":
        os.mkfifo(lock_path)
    else:
        os.symlink(outside / ("secret.txt" if kind == "symlink" else "new.txt"), lock_path)
    lock = RunLock(run)
    for attempt in (lock.acquire, lock.refuse_if_held, lock.holder):  # the launcher reads the holder first
        with pytest.raises(CheckpointError) as err:
            attempt()
        message = str(err.value)
        assert "\n" not in message and str(lock_path) in message and "remove it" in message
        assert ("a FIFO" if kind == "fifo" else "a symlink") in message
    assert not lock.held
    lock.release()
    assert os.path.lexists(lock_path) and untouched(outside)


def test_the_release_removes_only_the_lock_file_it_holds(tmp_path, outside):
    lock = RunLock(tmp_path)
    lock.acquire()
    lock_path = tmp_path / layout.RUN_LOCK
    lock_path.unlink()
    os.symlink(outside / "secret.txt", lock_path)  # put in its place while the run held it
    lock.release()
    assert lock_path.is_symlink() and untouched(outside)
    lock_path.unlink()
    lock.acquire()  # a regular file again: taken, and removed at release
    lock.release()
    assert not os.path.lexists(lock_path)


# --- our own files in the run folder --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_own_small_files_replace_a_link_or_fifo_in_their_place(tmp_path, outside, no_hang, kind):
    run = tmp_path / "run"
    run.mkdir()
    places = [run / layout.pointer_text_file(layout.LATEST), run / "marker"]
    for place in places:
        os.mkfifo(place) if kind == "fifo" else os.symlink(outside / "secret.txt", place)
    durable.write_atomic(places[0], b"epoch_0_step_1\n")
    durable.write_durable(places[1], "done")
    for place, text in zip(places, ("epoch_0_step_1\n", "done")):
        assert paths.regular_file_problem(place) is None and place.read_text() == text
    assert untouched(outside)


def test_a_latest_pointer_that_is_a_symlink_to_a_file_is_replaced_not_followed(tmp_path, outside):
    run = tmp_path / "run"
    (run / "epoch_0_step_1").mkdir(parents=True)
    os.symlink(outside / "secret.txt", run / layout.LATEST)
    durable.set_pointer(run, layout.LATEST, "epoch_0_step_1")
    assert os.readlink(run / layout.LATEST) == "epoch_0_step_1" and untouched(outside)


def test_pointer_text_read_through_a_link_designates_nothing(tmp_path, outside):
    (outside / "name.txt").write_text("epoch_0_step_1\n")
    run = tmp_path / "run"
    (run / "epoch_0_step_1").mkdir(parents=True)
    os.symlink(outside / "name.txt", run / layout.pointer_text_file(layout.LATEST))
    assert durable.read_pointer(run, layout.LATEST) is None


def test_staging_and_deleting_links_are_removed_themselves_never_followed(tmp_path, outside):
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(outside, run / layout.staging_name("epoch_0_step_9"))
    os.symlink(outside, run / layout.deleting_name("epoch_0_step_8"))
    assert discard_staging(run) == [layout.staging_name("epoch_0_step_9")]
    prune(run, RetentionPolicy(), "val_loss")
    assert sorted(os.listdir(run)) == [] and untouched(outside)
    os.symlink(outside, run / layout.staging_name("epoch_0_step_1"))
    assert reserve(run, "epoch_0_step_1").is_dir()  # the link removed, a real staging folder made
    assert not (run / layout.staging_name("epoch_0_step_1")).is_symlink() and untouched(outside)


def test_a_quarantine_folder_that_is_a_symlink_is_refused_and_nothing_moves_out(tmp_path, outside):
    run = tmp_path / "run"
    (run / "epoch_0_step_1").mkdir(parents=True)
    os.symlink(outside, run / layout.QUARANTINE_DIR)
    with pytest.raises(CheckpointError, match=r"quarantine' is a symlink, not a folder; .*remove it"):
        quarantine(run, "epoch_0_step_1", "damaged")
    assert (run / "epoch_0_step_1").is_dir() and untouched(outside)


def test_a_quarantine_note_in_the_way_is_replaced(tmp_path, outside, no_hang):
    run = tmp_path / "run"
    (run / "epoch_0_step_1").mkdir(parents=True)
    (run / "epoch_0_step_2").mkdir()
    (run / layout.QUARANTINE_DIR).mkdir()
    os.symlink(outside / "secret.txt", run / layout.QUARANTINE_DIR / layout.quarantine_note("epoch_0_step_1"))
    os.mkfifo(run / layout.QUARANTINE_DIR / layout.quarantine_note("epoch_0_step_2"))
    for name in ("epoch_0_step_1", "epoch_0_step_2"):
        quarantine(run, name, "damaged")
    assert [q["reason"] for q in catalog.quarantined_checkpoints(run)] == ["damaged", "damaged"] and untouched(outside)


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_logs_are_never_appended_or_read_through_a_link_or_fifo(tmp_path, outside, no_hang, kind):
    log = tmp_path / layout.TRAINING_LOG
    os.mkfifo(log) if kind == "fifo" else os.symlink(outside / "secret.txt", log)
    what = "a FIFO" if kind == "fifo" else "a symlink"
    with pytest.raises(UserError, match=f"the log '{log}' is {what}, not a regular file; .*remove it"):
        JsonlLog(log).append({"step": 1})
    with pytest.raises(UserError, match=f"cannot read the log '{log}'.*{what}"):
        read_jsonl(log)
    with pytest.raises(UserError):
        JsonlLog(log).truncate_after(0)
    assert untouched(outside)


def test_a_log_of_ours_is_appended_and_truncated(tmp_path):
    log = JsonlLog(tmp_path / layout.TRAINING_LOG)
    for step in (1, 2, 3):
        log.append({"step": step})
    log.truncate_after(2)
    assert [r["step"] for r in read_jsonl(log.path)] == [1, 2]


# --- folders inside a checkpoint ------------------------------------------------------------------------------------


def test_a_symlinked_folder_inside_the_root_is_refused_too(tmp_path):
    root = tmp_path / "ck"
    (root / "real").mkdir(parents=True)
    (root / "real" / "x").write_text("x")
    os.symlink("real", root / "model")
    with pytest.raises(paths.UnsafePathError, match="reached through the symlinked folder 'model'"):
        paths.path_inside(root, "model/x", "the manifest")
    assert paths.path_inside(root, "real/x", "the manifest") == root / "real" / "x"


def test_walks_list_regular_files_and_never_enter_a_linked_folder(tmp_path, outside):
    root = tmp_path / "ck"
    (root / "model").mkdir(parents=True)
    (root / "model" / "a.bin").write_bytes(b"12345")
    os.symlink(outside, root / "model" / "linked")
    os.symlink(outside / "secret.txt", root / "alias")
    os.mkfifo(root / "pipe")
    passed: list[tuple[str, str]] = []
    assert list(paths.walk_regular(root, passed)) == [("model/a.bin", 5)]
    assert sorted(passed) == [("alias", "a symlink, not a regular file"), ("model/linked", "a symlink, not a regular file"),
                              ("pipe", "a FIFO, not a regular file")]
    assert durable.files_under(root) == [root / "model" / "a.bin"]
    assert manifest.list_files(root) == {"model/a.bin": 5}
    assert catalog.size_on_disk(root) == 5
    durable.fsync_tree(root)


def test_read_text_follows_a_link_only_when_told(tmp_path, outside):
    os.symlink(outside / "secret.txt", tmp_path / "config.json")
    with pytest.raises(OSError, match="a symlink, not a regular file"):
        paths.read_text(tmp_path / "config.json")
    assert paths.read_text(tmp_path / "config.json", follow=True) == SECRET


def test_verify_reports_files_behind_a_symlinked_folder(templates, tmp_path, capsys):
    root, first, _ = copy_run(templates, "torch_save", tmp_path)
    shutil.move(first / "optim", first / "optim_real")
    os.symlink("optim_real", first / "optim")
    code, out, _ = cli(capsys, "verify", first)
    assert code == 1
    assert "reached through the symlinked folder 'optim'" in out


def test_consolidate_refuses_a_shard_or_side_file_that_is_a_link(templates, tmp_path, capsys, outside):
    root, first, second = copy_run(templates, "torch_save", tmp_path)
    shard = first / "model" / "__0_0.distcp"
    shutil.move(shard, outside / shard.name)
    os.symlink(outside / shard.name, shard)
    code, _, err = cli(capsys, "consolidate", first, "--out", tmp_path / "hf1", "--no-progress")
    assert code == 3
    assert one_error_line(err) == (f"error: '{shard}' is a symlink, not a regular file; an export reads only the "
                                   "regular files of a checkpoint, never through a link: replace it with the file "
                                   "itself")
    side = second / "model" / layout.HF_METADATA_DIR / "tokenizer.json"
    os.symlink(outside / "secret.txt", side)
    code, _, err = cli(capsys, "consolidate", second, "--out", tmp_path / "hf2", "--no-progress")
    assert code == 3 and f"'{side}' is a symlink, not a regular file" in one_error_line(err)
    assert not (tmp_path / "hf1").exists() and not (tmp_path / "hf2").exists()


def test_a_linked_hf_metadata_or_model_folder_is_refused(templates, tmp_path, outside):
    root, first, _ = copy_run(templates, "torch_save", tmp_path)
    meta = first / "model" / layout.HF_METADATA_DIR
    shutil.move(meta, outside / "meta")
    os.symlink(outside / "meta", meta)
    with pytest.raises(CheckpointError, match="is a symlink, not a folder"):
        read_hf_metadata(first / "model")
    from automodel_ckpt.export.plan import resolve_model_dir

    shutil.move(first / "model", outside / "model")
    os.symlink(outside / "model", first / "model")
    with pytest.raises(CheckpointError, match="model' is a symlink, not a folder"):
        resolve_model_dir(first)


# --- merge-lora -------------------------------------------------------------------------------------------------------


def _adapter_and_base(tmp_path: Path, base_name: str | None = None) -> tuple[Path, Path]:
    base = tmp_path / "base"
    base.mkdir()
    (base / layout.HF_CONFIG).write_text("{}")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / layout.ADAPTER_CONFIG).write_text(json.dumps({"base_model_name_or_path": base_name or str(base)}))
    return adapter, base


@pytest.mark.parametrize("name", ["tokenizer.json", layout.ADAPTER_WEIGHTS, layout.ADAPTER_CONFIG])
def test_merge_lora_refuses_an_adapter_file_that_is_a_link_or_fifo(tmp_path, outside, capsys, no_hang, name):
    adapter, _ = _adapter_and_base(tmp_path)
    (adapter / layout.HF_TOKENIZER_CONFIG).write_text("{}")
    if name == layout.ADAPTER_CONFIG:
        (tmp_path / name).write_text((adapter / name).read_text())
        (adapter / name).unlink()
        os.symlink(tmp_path / name, adapter / name)
    elif name == layout.ADAPTER_WEIGHTS:
        os.mkfifo(adapter / name)
    else:
        os.symlink("/proc/self/environ", adapter / name)
    code, _, err = cli(capsys, "merge-lora", adapter, "--out", tmp_path / "merged")
    assert code == 3
    line = one_error_line(err)
    assert f"'{adapter / name}' is {'a FIFO' if name == layout.ADAPTER_WEIGHTS else 'a symlink'}" in line
    assert not (tmp_path / "merged").exists() and untouched(outside)


def test_merge_lora_follows_base_links_only_into_the_base_repository(tmp_path, outside, capsys):
    from automodel_ckpt.export.lora_merge import _cache_repo, _side_files

    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "abc").write_text("{}")
    snapshot = repo / "snapshots" / "rev"
    snapshot.mkdir(parents=True)
    os.symlink("../../blobs/abc", snapshot / "tokenizer.json")
    assert _side_files(snapshot, follow=True, within=_cache_repo(snapshot)) == [(snapshot / "tokenizer.json", True)]

    adapter, base = _adapter_and_base(tmp_path)
    os.symlink(outside / "secret.txt", base / "tokenizer.json")
    code, _, err = cli(capsys, "merge-lora", adapter, "--out", tmp_path / "merged")
    assert code == 3
    assert one_error_line(err).startswith(f"error: '{base / 'tokenizer.json'}' is a symlink leading out of the base "
                                          "model folder")
    assert _side_files(base, follow=True, within=None) == [(base / "tokenizer.json", True)]  # --base: followed
