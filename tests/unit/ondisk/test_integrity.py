"""Checksummed checkpoints, `ckpt-train verify`, safe loading and the bad-input table (docs/integrity.md).

Small checkpoints are written in-process through a one-rank process group: a two-layer model, its AdamW state,
one global and one per-rank state object, in both model formats.
"""

from __future__ import annotations

import errno
import io
import json
import os
import pickle
import re
import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch

from automodel_ckpt.ondisk import catalog, checksum, layout, manifest
from automodel_ckpt.checkpoint.checkpointer import Checkpointer, SaveInfo
from automodel_ckpt.checkpoint.config import CheckpointConfig
from automodel_ckpt.ondisk.formats.safe_load import RestrictedUnpickler
from automodel_ckpt.cli.common import human_size
from automodel_ckpt.cli.verify import main as verify_main
from automodel_ckpt.distributed.env import init_distributed
from automodel_ckpt.errors import CheckpointError, DiskFullError
from tests.unit.checkpoint.ckpt_state import State

FORMATS = ("safetensors", "torch_save")
SHARD0 = "model/shard-00001-model-00001-of-00001.safetensors"


@pytest.fixture(scope="module")
def env():
    return init_distributed()


def make_checkpointer(env, root: Path, fmt: str = "safetensors", **kw) -> Checkpointer:
    cfg = CheckpointConfig(checkpoint_dir=str(root), model_save_format=fmt, save_consolidated="false", **kw)
    return Checkpointer(cfg, env, resolved_config_yaml="seed: 1\n", say=lambda _msg: None)


def save(ckpt: Checkpointer, state: State, step: int) -> Path:
    state.step()
    return ckpt.save(state.states(), SaveInfo(epoch=0, step=step, train_loss=1.0, val_loss=None, is_final=False))


@pytest.fixture(scope="module")
def templates(env, tmp_path_factory):
    """Per format, a checkpoint_dir with two checkpoints (steps 1 and 2), written once and copied per test."""
    out = {}
    for fmt in FORMATS:
        root = tmp_path_factory.mktemp(f"template_{fmt}") / "ck"
        ckpt = make_checkpointer(env, root, fmt)
        state = State()
        save(ckpt, state, 1)
        save(ckpt, state, 2)
        out[fmt] = root
    return out


@pytest.fixture(params=FORMATS)
def saved(request, env, tmp_path, templates):
    """A private copy of the template checkpoint_dir of the parametrized model format."""
    fmt = request.param
    shutil.copytree(templates[fmt], tmp_path / "ck", symlinks=True)
    ckpt = make_checkpointer(env, tmp_path / "ck", fmt)
    state = State()
    state.step()
    state.step()
    return ckpt, state, tmp_path / "ck" / "epoch_0_step_1", tmp_path / "ck" / "epoch_0_step_2"


def verify_cli(capsys, *args: str) -> tuple[int, str]:
    code = verify_main([str(a) for a in args])
    return code, capsys.readouterr().out


def load_fresh(ckpt: Checkpointer, path: Path, **state_kw) -> State:
    state = State(seed=123, **state_kw)
    ckpt.load(state.states(), path)
    return state


def flip_byte(file: Path, offset: int | None = None) -> None:
    data = bytearray(file.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0xFF
    file.write_bytes(bytes(data))


def reseal(folder: Path) -> None:
    """Rewrite a checkpoint's manifest for its current files (what an attacker could do)."""
    manifest.seal(folder, 0, 1)


# --- the manifest ------------------------------------------------------------------------------------


def test_manifest_lists_every_file_with_size_and_checksum(saved):
    _, _, _, second = saved
    data = json.loads((second / layout.MANIFEST_FILE).read_text())
    assert data["layout_version"] == layout.LAYOUT_VERSION
    assert data["checksum_algorithm"] == manifest.default_algorithm()
    on_disk = {p.relative_to(second).as_posix(): p.stat().st_size for p in second.rglob("*") if p.is_file()}
    on_disk.pop(layout.MANIFEST_FILE)
    assert {rel: e["size"] for rel, e in data["files"].items()} == on_disk
    for must in ("config.yaml", "counter.pt", "cursor/cursor_dp_rank_0.pt", "optim/.metadata", "optim/__0_0.distcp"):
        assert must in data["files"]
    if (second / layout.METADATA_FILE).exists():
        assert layout.METADATA_FILE in data["files"]
    rel = "optim/__0_0.distcp"
    assert data["files"][rel]["checksum"] == manifest.hash_file(second / rel, data["checksum_algorithm"])[1]
    assert data["total_bytes"] == sum(on_disk.values())


def test_fresh_checkpoint_resumes_and_verifies(saved, capsys):
    ckpt, state, first, second = saved
    ckpt._cfg.verify_on_load = True
    loaded = load_fresh(ckpt, second)
    for a, b in zip(loaded.model.parameters(), state.model.parameters()):
        assert torch.equal(a, b)
    assert loaded.counter.n == 2 and loaded.cursor.n == 20
    code, out = verify_cli(capsys, second)
    assert code == 0 and "verify: OK" in out and f"ok                 {layout.CONFIG_FILE}" in out
    size = human_size(manifest.read_manifest(second)["total_bytes"])
    assert f"files, {size}, layout" in out and size.endswith("KiB")  # sizes read as `inspect` prints them
    code, out = verify_cli(capsys, ckpt.stats.dir)
    assert code == 0, out
    assert "pointer LATEST -> epoch_0_step_2: ok" in out and "verify: OK (2 checkpoint(s))" in out


def test_hash_shares_follow_the_writer_rank():
    files = {SHARD0: 100, "model/shard-00002-model-00001-of-00001.safetensors": 100, "optim/__1_0.distcp": 50,
             "rng/rng_dp_rank_1.pt": 5, "config.yaml": 7, "optim/.metadata": 3, "big.pt": 1000}
    shares = manifest.assign(files, 2)
    assert SHARD0 in shares[0] and "optim/__1_0.distcp" in shares[1] and "rng/rng_dp_rank_1.pt" in shares[1]
    assert sorted(shares[0] + shares[1]) == sorted(files)
    assert [sorted(s) for s in manifest.assign(files, 1)] == [sorted(files)]


def test_crc32_manifest_verifies(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"x" * 1000)
    size, digest = manifest.hash_file(tmp_path / "a.bin", manifest.CRC32)
    manifest.write(tmp_path, manifest.build_manifest(tmp_path, {"a.bin": size}, {"a.bin": digest}, manifest.CRC32))
    assert manifest.verify_manifest(tmp_path).ok
    flip_byte(tmp_path / "a.bin")
    assert [v.status for v in manifest.verify_manifest(tmp_path).verdicts] == [manifest.CHECKSUM_MISMATCH]


def _resident(key: str) -> int:
    return int(re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1)) << 10


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc peak reset")
def test_hashing_a_large_file_keeps_one_chunk_resident_not_the_file(tmp_path):
    """A mapped file's pages count in the process's resident memory: hashing drops each chunk once hashed, so the
    peak grows by about one chunk (a manifest's checksums of a consolidated export stayed resident on rank 0)."""
    big = tmp_path / "big.bin"
    with open(big, "wb") as f:
        for i in range(12):
            f.write(bytes([i]) * (8 << 20))  # 96 MiB, in the page cache
    want = checksum.hasher(checksum.CRC32)
    want.update(big.read_bytes())
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from what is resident now
    before = _resident("VmRSS")
    assert checksum.hash_file(big, checksum.CRC32) == (96 << 20, want.hexdigest())
    assert _resident("VmHWM") - before < 40 << 20


def test_size_check_needs_no_checksum_module(tmp_path, monkeypatch):
    """The size check every load makes never imports the hashing module (xxhash here: made unimportable)."""
    (tmp_path / "a.bin").write_bytes(b"x" * 1000)
    manifest.write(tmp_path, manifest.build_manifest(tmp_path, {"a.bin": 1000}, {"a.bin": "0" * 16}, checksum.XXH3_64))
    monkeypatch.setitem(sys.modules, "xxhash", None)  # ``import xxhash`` raises ImportError
    assert manifest.verify_manifest(tmp_path, checksums=False).ok
    (tmp_path / "a.bin").write_bytes(b"x" * 999)
    assert [v.status for v in manifest.verify_manifest(tmp_path, checksums=False).verdicts] != [manifest.OK]
    assert "install the 'xxhash' package" in manifest.verify_manifest(tmp_path).problem


# --- bad inputs ------------------------------------------------------------------------------------------


def test_truncated_shard(saved, capsys):
    ckpt, _, _, second = saved
    rel = SHARD0 if ckpt._cfg.model_save_format == "safetensors" else "model/__0_0.distcp"
    with open(second / rel, "r+b") as f:
        f.truncate(100)
    with pytest.raises(CheckpointError) as err:
        load_fresh(ckpt, second)
    msg = str(err.value)
    assert "\n" not in msg and rel in msg and "size mismatch" in msg and "on disk 100" in msg
    code, out = verify_cli(capsys, second)
    assert code == 1 and f"size mismatch      {rel}" in out
    # without a manifest (an older checkpoint) the format readers still fail with one line naming the folder
    (second / layout.MANIFEST_FILE).unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointError) as err:
            load_fresh(ckpt, second)
    assert "\n" not in str(err.value) and str(second / "model") in str(err.value)


def test_flipped_byte_caught_by_verify_and_verify_on_load(saved, capsys):
    ckpt, _, _, second = saved
    rel = "optim/__0_0.distcp"
    flip_byte(second / rel)
    code, out = verify_cli(capsys, second)
    assert code == 1 and f"checksum mismatch  {rel}" in out
    code, out = verify_cli(capsys, "--sizes-only", second)
    assert code == 0  # sizes alone cannot see a flipped byte
    ckpt._cfg.verify_on_load = True
    with pytest.raises(CheckpointError) as err:
        load_fresh(ckpt, second)
    assert "\n" not in str(err.value) and rel in str(err.value) and "checksum mismatch" in str(err.value)


@pytest.mark.parametrize("folder", ["optim", "model"])
def test_missing_dcp_metadata(saved, capsys, folder):
    ckpt, _, _, second = saved
    if folder == "model" and ckpt._cfg.model_save_format == "safetensors":
        pytest.skip("safetensors model folders have no .metadata")
    rel = f"{folder}/{layout.DCP_METADATA}"
    (second / rel).unlink()
    with pytest.raises(CheckpointError) as err:
        load_fresh(ckpt, second)
    assert f"{rel}: missing" in str(err.value)
    code, out = verify_cli(capsys, second)
    assert code == 1 and f"missing            {rel}" in out
    (second / layout.MANIFEST_FILE).unlink()  # no manifest: the safe reader names the missing file itself
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointError, match=r"\.metadata' is missing"):
            load_fresh(ckpt, second)


def test_missing_rank_file(saved, capsys):
    ckpt, _, _, second = saved
    rel = layout.rank_state_file("cursor", 0)
    (second / rel).unlink()
    with pytest.raises(CheckpointError) as err:
        load_fresh(ckpt, second)
    assert f"{rel}: missing" in str(err.value)
    code, out = verify_cli(capsys, ckpt.stats.dir)
    assert code == 1 and f"missing            {rel}" in out
    assert "pointer LATEST -> epoch_0_step_2: FAILED (that checkpoint is damaged)" in out


@pytest.mark.parametrize("other", [{"hidden": 16}, {"layers": 3}])
def test_checkpoint_of_a_different_model(saved, other):
    ckpt, _, _, second = saved
    with pytest.raises(CheckpointError) as err:
        load_fresh(ckpt, second, **other)
    msg = str(err.value)
    assert "\n" not in msg and "does not fit this model" in msg and str(second / "model") in msg
    if "hidden" in other:
        assert "0.weight: shape [8, 4] in the checkpoint, [16, 4] in the model" in msg
    else:
        assert "2.weight: in the model, not in the checkpoint" in msg


def test_unexpected_file_is_reported_by_verify(saved, capsys):
    ckpt, _, _, second = saved
    (second / "model" / "stray.bin").write_bytes(b"?")
    code, out = verify_cli(capsys, second)
    assert code == 1 and "unexpected file    model/stray.bin" in out
    load_fresh(ckpt, second)  # extra files do not stop a resume


def test_read_only_checkpoint_dir_fails_at_startup(env, tmp_path, monkeypatch):
    import tempfile

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(tempfile, "TemporaryFile", read_only)
    with pytest.raises(CheckpointError) as err:
        make_checkpointer(env, tmp_path / "ck")
    assert str(err.value) == (
        f"checkpoint.checkpoint_dir: cannot write to '{tmp_path / 'ck'}' (Read-only file system); "
        "choose a writable folder or set checkpoint.enabled: false"
    )


def test_unwritable_checkpoint_dir_real(env, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(CheckpointError, match="cannot write to .*a_file/ck"):
        make_checkpointer(env, blocker / "ck")
    if os.geteuid() != 0:  # root ignores permission bits
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        try:
            with pytest.raises(CheckpointError, match="Permission denied"):
                make_checkpointer(env, ro / "ck")
        finally:
            ro.chmod(0o755)


def _raiser(code: int):
    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code))
    return fail


_enospc = _raiser(errno.ENOSPC)


@pytest.mark.parametrize("where", ["dcp_write", "rank_file", "metadata", "manifest", "edquot", "erofs", "async"])
def test_disk_full_during_save_keeps_previous_checkpoints(saved, monkeypatch, capsys, where):
    ckpt, state, first, second = saved
    before = manifest.verify_manifest(second)
    assert before.ok
    reason = "no space left on device"
    if where in ("dcp_write", "edquot", "erofs", "async"):
        import torch.distributed.checkpoint.filesystem as fs

        from automodel_ckpt.ondisk.fastio import filewrite

        code = {"edquot": errno.EDQUOT, "erofs": errno.EROFS}.get(where, errno.ENOSPC)
        reason = {"edquot": "disk quota exceeded", "erofs": "the filesystem is read-only"}.get(where, reason)
        monkeypatch.setattr(fs, "_write_item", _raiser(code))  # torch's writers
        monkeypatch.setattr(filewrite, "_pwrite_all", _raiser(code))  # ours (the model and optimizer files)
        if where == "async":
            ckpt = make_checkpointer(ckpt._env, ckpt.stats.dir, ckpt._cfg.model_save_format, is_async=True)
    elif where == "rank_file":
        from automodel_ckpt.checkpoint.save import writer as local_files

        real_write = local_files.write_files  # the per-rank and global state files
        monkeypatch.setattr(local_files, "write_files",
                            lambda files: _enospc() if any("cursor" in str(f) for f in files) else real_write(files))
    elif where == "metadata":
        from automodel_ckpt.checkpoint.save import writer as local_files

        monkeypatch.setattr(local_files, "write_metadata", _enospc)
    else:
        monkeypatch.setattr(manifest, "write", _enospc)
    with pytest.raises(DiskFullError) as err:
        save(ckpt, state, 3)
        ckpt.finalize()  # async: the background write's failure is raised when the save is completed
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"saving a checkpoint in '{ckpt.stats.dir}' failed: {reason} (needs about ")
    assert "free there" in message and "'epoch_0_step_2' and the pointers are untouched" in message
    monkeypatch.undo()
    assert not list(ckpt.stats.dir.glob(layout.STAGING_PREFIX + "*"))  # removed at once
    assert [r.name for r in catalog.scan_checkpoints(ckpt.stats.dir)] == ["epoch_0_step_1", "epoch_0_step_2"]
    assert os.readlink(ckpt.stats.dir / layout.LATEST) == "epoch_0_step_2"
    assert catalog.resolve_restore_from(ckpt.stats.dir, None) == second
    code, out = verify_cli(capsys, ckpt.stats.dir)
    assert code == 0
    assert manifest.verify_manifest(second).ok and manifest.verify_manifest(first).ok
    third = save(ckpt, state, 3)  # space is back: the same step saves
    ckpt.finalize()
    assert manifest.verify_manifest(third).ok and not list(ckpt.stats.dir.glob(layout.STAGING_PREFIX + "*"))


def test_out_of_room_is_recognised_from_errno_dcp_failures_and_remote_text():
    from torch.distributed.checkpoint.api import CheckpointException

    from automodel_ckpt.ondisk import outofroom as diskfull

    assert diskfull.out_of_room(OSError(errno.ENOSPC, "x")) == errno.ENOSPC
    dcp = CheckpointException("save", {1: (OSError(errno.EDQUOT, "quota"), "traceback")})
    assert diskfull.out_of_room(dcp) == errno.EDQUOT
    chained = CheckpointError("writing 'x' failed on rank 0")
    chained.__cause__ = dcp
    assert diskfull.out_of_room(chained) == errno.EDQUOT
    remote = CheckpointError(f"writing 'x' failed on rank 1: OSError: [Errno 30] {os.strerror(errno.EROFS)}: 'f'")
    assert diskfull.out_of_room(remote) == errno.EROFS
    assert diskfull.out_of_room(OSError(errno.EIO, "x")) is None
    assert diskfull.out_of_room(CheckpointError("cannot load 'x': bad header")) is None
    assert diskfull.message(errno.ENOSPC, "saving a checkpoint", Path("/ck"), 5 * 2**20, 2**20, "then") == (
        "saving a checkpoint in '/ck' failed: no space left on device (needs about 5.0 MiB, 1.0 MiB free there); "
        "free space (or raise the quota) or choose a folder on a larger filesystem; then")


def test_dangling_latest(saved, capsys):
    ckpt, _, first, second = saved
    shutil.rmtree(second)
    with pytest.warns(UserWarning, match="LATEST points to 'epoch_0_step_2'.*resuming from the newest complete "
                                         "checkpoint 'epoch_0_step_1'"):
        assert catalog.resolve_restore_from(ckpt.stats.dir, None) == first
    with pytest.raises(CheckpointError) as err:
        catalog.resolve_restore_from(ckpt.stats.dir, "LATEST")
    assert "LATEST points to 'epoch_0_step_2', which is not a checkpoint" in str(err.value)
    assert "checkpoints there: epoch_0_step_1" in str(err.value)
    code, out = verify_cli(capsys, ckpt.stats.dir)
    assert code == 1 and "pointer LATEST -> epoch_0_step_2: FAILED (not a checkpoint in" in out


@pytest.mark.parametrize("file", [layout.MANIFEST_FILE, layout.METADATA_FILE])
def test_newer_layout_version_is_refused(saved, capsys, file):
    ckpt, _, _, second = saved
    target = second / file
    data = json.loads(target.read_text()) if target.exists() else {"step": 2}
    data["layout_version"] = layout.LAYOUT_VERSION + 1
    target.write_text(json.dumps(data))
    with pytest.raises(CheckpointError) as err:
        load_fresh(ckpt, second)
    expected = f"written by a newer automodel-ckpt (layout {layout.LAYOUT_VERSION + 1} > {layout.LAYOUT_VERSION}"
    assert expected in str(err.value) and "upgrade" in str(err.value)
    code, out = verify_cli(capsys, second)
    assert code == 1 and expected in out


def test_missing_or_garbled_manifest(saved, capsys):
    ckpt, _, _, second = saved
    (second / layout.MANIFEST_FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match="manifest.json' is unreadable"):
        load_fresh(ckpt, second)
    (second / layout.MANIFEST_FILE).unlink()
    with pytest.warns(UserWarning, match="has no manifest.json"):
        load_fresh(ckpt, second)  # an older checkpoint still loads
    code, out = verify_cli(capsys, second)
    assert code == 1 and "no manifest.json" in out


# --- safe loading ------------------------------------------------------------------------------------------


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("folder", ["optim", "model"])
def test_malicious_dcp_metadata_is_refused(saved, tmp_path, folder):
    ckpt, _, _, second = saved
    if folder == "model" and ckpt._cfg.model_save_format == "safetensors":
        pytest.skip("safetensors model folders have no pickle")
    marker = tmp_path / "pwned"
    target = second / folder / layout.DCP_METADATA
    target.write_bytes(pickle.dumps(_Evil(marker)))
    reseal(second)  # checksums are not signatures: the manifest now matches the planted file
    with pytest.raises(CheckpointError) as err:
        load_fresh(ckpt, second)
    assert str(err.value) == f"refusing to load '{target}': global 'posix.system' is not allowed in checkpoint metadata"
    assert not marker.exists()


def test_malicious_pickled_entry_in_distcp_is_refused(env, tmp_path):
    """Non-tensor DCP entries are unpickled with weights_only=True (torch's default planner would run them)."""
    import torch.distributed.checkpoint as dcp

    from automodel_ckpt.ondisk.formats.sharded import DCP_FILES, _load, _reader

    marker = tmp_path / "pwned"
    dcp.save({"w": torch.ones(2), "extra": _Evil(marker)}, checkpoint_id=str(tmp_path / "d"))
    assert not marker.exists()
    with pytest.raises(CheckpointError) as err:
        _load({"w": torch.zeros(2), "extra": None}, tmp_path / "d", _reader(tmp_path / "d", DCP_FILES), None,
              strict_keys=False)
    assert "refusing to load entry 'extra'" in str(err.value) and "\n" not in str(err.value)
    assert not marker.exists()


@pytest.mark.parametrize("module,name", [("os", "system"), ("builtins", "eval"), ("subprocess", "Popen"),
                                         ("torch", "load"), ("torch.distributed.checkpoint.metadata", "torch")])
def test_restricted_unpickler_refuses_globals(module, name):
    payload = b"c" + module.encode() + b"\n" + name.encode() + b"\n."  # protocol 0 GLOBAL opcode
    with pytest.raises(pickle.UnpicklingError, match="not allowed in checkpoint metadata"):
        RestrictedUnpickler(io.BytesIO(payload)).load()


def test_files_added_after_the_save_can_be_recorded(saved, capsys):
    _, _, _, second = saved
    export = second / "model" / "consolidated"
    export.mkdir()
    (export / "model.safetensors").write_bytes(b"weights")
    code, out = verify_cli(capsys, second)
    assert code == 1 and "unexpected file    model/consolidated/model.safetensors" in out
    assert manifest.add_files_to_manifest(export)
    assert manifest.verify_manifest(second).ok
    (export / "model.safetensors").write_bytes(b"other!!")
    assert [v.status for v in manifest.verify_manifest(second).bad] == [manifest.CHECKSUM_MISMATCH]
    assert not manifest.add_files_to_manifest(second.parent)  # not inside a checkpoint
