"""Checkpoints from elsewhere are untrusted input: no pickle in them runs, no path in them leads outside.

Small checkpoints are written in-process once per format (a two-layer model, AdamW, a global and a per-rank state
object) and tampered copies are handed to the verbs: consolidate, verify, inspect, resume. Bucket listings are
exercised on fsspec's in-memory filesystem, which (like S3, unlike the SeaweedFS test server) stores keys with
``..`` as they are; tests/integration/test_untrusted_object_store.py does the same on the real server.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from automodel_ckpt.ondisk import catalog, layout, manifest, paths
from automodel_ckpt.checkpoint.checkpointer import Checkpointer, SaveInfo
from automodel_ckpt.checkpoint.config import CheckpointConfig
from automodel_ckpt.checkpoint.objectstore.run import RemoteRun, fetch
from automodel_ckpt.checkpoint.objectstore.store import ObjectStore, plain_names
from automodel_ckpt.cli import main as cli_main
from automodel_ckpt.distributed.env import init_distributed
from automodel_ckpt.errors import CheckpointError
from tests.unit.checkpoint.ckpt_state import State

FORMATS = ("safetensors", "torch_save")
REPO = Path(__file__).resolve().parents[3]


class Evil:
    """A pickle that would create ``marker`` when unpickled by an unrestricted reader."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def env():
    return init_distributed()


def checkpointer(env, root: Path, fmt: str, **kw) -> Checkpointer:
    cfg = CheckpointConfig(checkpoint_dir=str(root), model_save_format=fmt, save_consolidated="false", **kw)
    return Checkpointer(cfg, env, resolved_config_yaml="seed: 1\n", say=lambda _msg: None)


@pytest.fixture(scope="module")
def templates(env, tmp_path_factory):
    """Per format, a checkpoint_dir with checkpoints at steps 1 and 2, written once and copied per test."""
    out = {}
    for fmt in FORMATS:
        root = tmp_path_factory.mktemp(f"untrusted_{fmt}") / "ck"
        ckpt, state = checkpointer(env, root, fmt), State()
        for step in (1, 2):
            state.step()
            ckpt.save(state.states(), SaveInfo(epoch=0, step=step, train_loss=1.0, val_loss=None, is_final=False))
        out[fmt] = root
    return out


def copy_run(templates, fmt: str, tmp_path: Path) -> tuple[Path, Path, Path]:
    root = tmp_path / "ck"
    shutil.copytree(templates[fmt], root, symlinks=True)
    return root, root / "epoch_0_step_1", root / "epoch_0_step_2"


def cli(capsys, *args: object) -> tuple[int, str, str]:
    code = cli_main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# --- pickles: every place a checkpoint holds one ----------------------------------------------------------------


def _plant_distcp_entry(folder: Path, marker: Path) -> None:
    """Rewrite DCP folder ``folder`` with its optimizer hyperparameter ``lr`` replaced by a crafted pickle."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from automodel_ckpt.ondisk.formats.safe_load import SafeFileSystemReader, SafeLoadPlanner, load_dcp_metadata

    md = load_dcp_metadata(folder / layout.DCP_METADATA)
    flat: dict[str, object] = {k: torch.empty(v.size, dtype=v.properties.dtype)
                               for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    flat.update({k: None for k in md.state_dict_metadata if k not in flat})
    dcp.load(flat, storage_reader=SafeFileSystemReader(str(folder)), planner=SafeLoadPlanner(folder))
    lr = next(k for k in flat if k.endswith(".lr"))
    flat[lr] = Evil(marker)
    shutil.rmtree(folder)
    dcp.save(flat, checkpoint_id=str(folder))


PLACES = ["model/.metadata", "optim/.metadata", "counter.pt", "cursor/cursor_dp_rank_0.pt", "optim/__0_0.distcp"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("place", PLACES)
def test_a_crafted_pickle_never_runs_in_any_verb(env, templates, tmp_path, capsys, fmt, place):
    if place == "model/.metadata" and fmt == "safetensors":
        pytest.skip("a safetensors model folder holds no pickle")
    root, first, second = copy_run(templates, fmt, tmp_path)
    marker = tmp_path / "pwned"
    if place.endswith(".distcp"):
        _plant_distcp_entry(second / "optim", marker)
    else:
        (second / place).write_bytes(pickle.dumps(Evil(marker), protocol=2))
    manifest.seal(second, 0, 1)  # checksums are no signature: an attacker rewrites the manifest too
    assert not marker.exists()

    assert cli(capsys, "verify", second)[0] == 0  # sizes and checksums match; nothing is unpickled
    assert cli(capsys, "inspect", root)[0] == 0
    code, _, err = cli(capsys, "consolidate", second, "--out", tmp_path / "hf", "--no-progress")
    if place == "model/.metadata":
        assert code == 3
        assert one_error_line(err) == (f"error: refusing to load '{second / place}': global 'posix.system' is not "
                                       "allowed in checkpoint metadata")
    else:
        assert code == 0, err
    assert not marker.exists()

    ckpt, state = checkpointer(env, root, fmt), State(seed=7)
    if place.endswith(".distcp"):  # only the load itself reads entries: one line, the run stops
        with pytest.raises(CheckpointError) as exc:
            ckpt.resume(state.states()).path
        assert "refusing to load entry 'param_groups.0.lr'" in str(exc.value) and "\n" not in str(exc.value)
    else:  # the check before the load refuses it: quarantined, the run resumes from the checkpoint before
        assert ckpt.resume(state.states()).path == first
        assert (root / layout.QUARANTINE_DIR / second.name).is_dir()
    assert not marker.exists()


# --- paths in a manifest -------------------------------------------------------------------------------------------


def _list(checkpoint: Path, entries: dict[str, Path | int]) -> None:
    """Add manifest entries: a path with the size and checksum of ``file`` (or ``size`` bytes, no checksum)."""
    data = json.loads((checkpoint / layout.MANIFEST_FILE).read_text())
    for rel, source in entries.items():
        if isinstance(source, Path):
            size, digest = manifest.hash_file(source, data["checksum_algorithm"])
            data["files"][rel] = {"size": size, "checksum": digest}
        else:
            data["files"][rel] = {"size": source, "checksum": "0"}
    (checkpoint / layout.MANIFEST_FILE).write_text(json.dumps(data))


def test_verify_refuses_manifest_paths_outside_the_checkpoint(templates, tmp_path, capsys):
    root, first, second = copy_run(templates, "safetensors", tmp_path)
    secret = tmp_path / "secret.txt"
    secret.write_text("not part of any checkpoint\n")
    _list(first, {"../../secret.txt": secret})
    _list(second, {str(secret): secret})
    code, out, _ = cli(capsys, "verify", root)
    assert code == 1
    assert f"FAILED: '{first / layout.MANIFEST_FILE}' names the unsafe path '../../secret.txt' (a '..' component)" \
        in out
    assert f"FAILED: '{second / layout.MANIFEST_FILE}' names the unsafe path '{secret}' (absolute)" in out
    assert "secret.txt" not in "\n".join(line for line in out.splitlines() if " ok " in f" {line} ")


def test_verify_never_reads_a_device_a_fifo_or_a_symlink_out(templates, tmp_path):
    """Entries naming /dev/zero (size 0), a symlink to it and a FIFO: refused before a byte is read (a reader
    would never finish). In a subprocess with a timeout, so a regression fails instead of hanging."""
    root, first, second = copy_run(templates, "safetensors", tmp_path)
    third, fourth = root / "epoch_0_step_3", root / "epoch_0_step_4"
    for folder, step in ((third, 3), (fourth, 4)):
        shutil.copytree(second, folder)
        meta = json.loads((folder / layout.METADATA_FILE).read_text())
        (folder / layout.METADATA_FILE).write_text(json.dumps({**meta, "step": step}))
        manifest.seal(folder, 0, 1)
    _list(first, {"/dev/zero": 0})
    _list(second, {"model/../../../../../../../dev/zero": 0})
    os.symlink("/dev/zero", third / "model" / "zero")
    os.symlink(layout.CONFIG_FILE, third / "alias")  # inside the checkpoint, still no regular file
    _list(third, {"model/zero": 0, "alias": 0})
    os.mkfifo(fourth / "model" / "pipe")
    _list(fourth, {"model/pipe": 0})
    proc = subprocess.run([sys.executable, "-m", "automodel_ckpt", "verify", str(root)], capture_output=True,
                          text=True, timeout=120, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "names the unsafe path '/dev/zero' (absolute)" in proc.stdout
    assert "names the unsafe path 'model/../../../../../../../dev/zero' (a '..' component)" in proc.stdout
    unreadable = f"{manifest.UNREADABLE:<{len(manifest.CHECKSUM_MISMATCH)}}"
    assert f"{unreadable}  model/zero  (leads out of the checkpoint through a symlink)" in proc.stdout
    assert f"{unreadable}  alias  (a symlink, not a regular file)" in proc.stdout
    assert f"{unreadable}  model/pipe  (a FIFO, not a regular file)" in proc.stdout
    assert "verify: FAILED (4 of 4 checkpoint(s) damaged" in proc.stdout


_VERBS_ON = """
import sys
from pathlib import Path
from automodel_ckpt.cli import main
from automodel_ckpt.distributed.env import init_distributed
from tests.unit.checkpoint.ckpt_state import State
from tests.unit.checkpoint.test_untrusted import checkpointer
root = Path(sys.argv[1])
print("verify", main(["verify", str(root)]), flush=True)
print("inspect", main(["inspect", str(root)]), flush=True)
print("resumed", checkpointer(init_distributed(), root, "torch_save").resume(State(seed=3).states()).path, flush=True)
"""


def test_fifos_in_place_of_small_files_never_block_a_verb(templates, tmp_path):
    """A FIFO as manifest.json, metadata.json or LATEST.txt: verify, inspect and resume go on (a reader of a FIFO
    would wait forever). In a subprocess with a timeout, so a regression fails instead of hanging."""
    root, first, second = copy_run(templates, "torch_save", tmp_path)
    third = root / "epoch_0_step_3"
    shutil.copytree(second, third)
    (second / layout.MANIFEST_FILE).unlink()
    os.mkfifo(second / layout.MANIFEST_FILE)
    (third / layout.METADATA_FILE).unlink()
    os.mkfifo(third / layout.METADATA_FILE)
    (root / layout.LATEST).unlink()
    os.mkfifo(root / layout.pointer_text_file(layout.LATEST))
    proc = subprocess.run([sys.executable, "-c", _VERBS_ON, str(root)], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verify 1\n" in proc.stdout and "inspect 0\n" in proc.stdout
    assert f"resumed {first}\n" in proc.stdout
    assert "a FIFO, not a regular file" in proc.stdout
    assert sorted(p.name for p in (root / layout.QUARANTINE_DIR).iterdir() if p.is_dir()) == [second.name, third.name]


@pytest.mark.parametrize("entry", ["../outside.bin", "ABSOLUTE"])
def test_resume_with_verify_on_load_quarantines_a_manifest_naming_outside_paths(env, templates, tmp_path, entry):
    root, first, second = copy_run(templates, "torch_save", tmp_path)
    outside = root / "outside.bin"
    outside.write_bytes(b"x" * 100)
    rel = str(outside) if entry == "ABSOLUTE" else entry
    _list(second, {rel: outside})
    ckpt, state = checkpointer(env, root, "torch_save", verify_on_load=True), State(seed=7)
    assert ckpt.resume(state.states()).path == first
    note = json.loads((root / layout.QUARANTINE_DIR / layout.quarantine_note(second.name)).read_text())
    assert f"names the unsafe path {rel!r}" in note["reason"]


def test_a_pointer_naming_a_path_designates_no_checkpoint(templates, tmp_path):
    root, first, _ = copy_run(templates, "safetensors", tmp_path)
    for target in ("..", "/tmp", f"{first.name}/model"):
        (root / layout.LATEST).unlink(missing_ok=True)
        (root / layout.pointer_text_file(layout.LATEST)).write_text(target + "\n")
        assert catalog.pointer_target(root, layout.LATEST) is None, target
        assert catalog.latest_checkpoint(root).name == "epoch_0_step_2"


def test_dcp_metadata_naming_files_outside_its_folder_is_refused(templates, tmp_path, capsys):
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    from automodel_ckpt.ondisk.formats.safe_load import load_dcp_metadata

    root, _, second = copy_run(templates, "torch_save", tmp_path)
    original = load_dcp_metadata(second / "model" / layout.DCP_METADATA)
    storage = dict(original.storage_data)
    for rel in ("../../../secret.distcp", "/etc/hostname"):
        md = original
        md.storage_data = {k: _StorageInfo(rel, v.offset, v.length) for k, v in storage.items()}
        (second / "model" / layout.DCP_METADATA).write_bytes(pickle.dumps(md))
        code, _, err = cli(capsys, "consolidate", second, "--out", tmp_path / "hf", "--no-progress")
        assert code == 3
        assert f"names the unsafe path {rel!r}" in one_error_line(err)


def test_an_index_naming_files_outside_the_base_folder_is_refused(tmp_path):
    from automodel_ckpt.export.hf_metadata import original_tensors

    base = tmp_path / "base"
    base.mkdir()
    (base / layout.HF_INDEX).write_text(json.dumps({"weight_map": {"w": "../../etc/model.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"names the unsafe path '../../etc/model.safetensors'"):
        original_tensors(base)


# --- the validator, as properties -----------------------------------------------------------------------------------

_PARTS = st.sampled_from(["..", ".", "", "a", "model", "secret.txt", "x.bin", " ", "C:", "a\\b", "\x00", "\n",
                          "é", "~", "...", "/"])
_RELS = st.one_of(st.lists(_PARTS, min_size=1, max_size=6).map("/".join), st.text(max_size=20))


@settings(max_examples=300, deadline=None)
@given(rel=_RELS)
def test_a_plain_path_never_leaves_its_root(rel):
    root = Path("/srv/ck/epoch_0_step_1")
    if paths.path_problem(rel) is None:
        assert Path(os.path.normpath(root / rel)).is_relative_to(root) and Path(os.path.normpath(root / rel)) != root
        assert not rel.startswith("/") and ".." not in rel.split("/")
    else:
        with pytest.raises(CheckpointError, match="names the unsafe path"):
            paths.check_path(rel, "x")


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    """``outer/`` holding a secret file beside ``outer/run/``; tests work below ``outer/run/``."""
    outer = tmp_path_factory.mktemp("sandbox") / "outer"
    (outer / "run").mkdir(parents=True)
    (outer / "secret.txt").write_text("secret\n")
    return outer


def _snapshot(folder: Path, skip: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in folder.rglob("*")
            if p.is_file() and not p.is_symlink() and not p.is_relative_to(skip)}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(_PARTS, min_size=1, max_size=6), absolute=st.booleans())
def test_no_manifest_entry_is_read_outside_its_checkpoint(sandbox, parts, absolute):
    """Whatever a manifest lists, verify reads only regular files inside the checkpoint: an entry naming the
    secret beside it (with its exact size and checksum) is never reported as a file that matches."""
    secret = sandbox / "secret.txt"
    rel = str(sandbox) + "/" + "/".join(parts) if absolute else "/".join(parts)
    checkpoint = sandbox / "run" / f"c-{uuid.uuid4().hex[:8]}"
    (checkpoint / "model").mkdir(parents=True)
    size, digest = manifest.hash_file(secret, manifest.default_algorithm())
    data = {"checksum_algorithm": manifest.default_algorithm(), "files": {rel: {"size": size, "checksum": digest}}}
    (checkpoint / layout.MANIFEST_FILE).write_text(json.dumps(data))
    report = manifest.verify_manifest(checkpoint)
    shutil.rmtree(checkpoint)
    assert not report.ok  # nothing inside the checkpoint is the secret
    target = Path(os.path.normpath(checkpoint / rel))
    assert report.problem is not None or target.is_relative_to(checkpoint)


_NAMES = st.one_of(_PARTS, st.text(min_size=1, max_size=12))


def _drop_bucket(store: ObjectStore, bucket: str) -> None:
    try:
        store.fs.rm(bucket, recursive=True)
    except FileNotFoundError:  # nothing was stored (a key fsspec reads as another URL, say)
        pass


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=_NAMES, rel=st.lists(_PARTS, min_size=1, max_size=5).map("/".join))
@example(name="::", rel="model/x").via("fsspec reads '::' as a chain of URLs")
@example(name="*", rel="model/x").via("fsspec expands a glob")
def test_no_bucket_prefix_or_remote_manifest_entry_reaches_outside_the_mirror(sandbox, name, rel):
    """A bucket (fsspec's in-memory store keeps ``..`` keys as S3 does) with a committed prefix of any name whose
    manifest lists any path: pulling the catalog and fetching it never writes, reads or removes anything outside
    the mirror, and only a plain name is taken for a checkpoint."""
    bucket = f"b-{uuid.uuid4().hex[:10]}"
    store = ObjectStore(f"memory://{bucket}/run")
    files = {rel: {"size": 6, "checksum": "0"}}
    try:
        for key, data in ((f"{name}/{layout.MANIFEST_FILE}", json.dumps({"files": files})),
                          (f"{name}/{layout.METADATA_FILE}", json.dumps({"step": 1, "epoch": 0})),
                          (f"{name}/{rel}", "pwned\n")):
            store.fs.pipe(f"{store.root}/{key}", data.encode())
    except OSError:  # the in-memory store cannot hold this set of keys (a key that is also a folder)
        _drop_bucket(store, bucket)
        assume(False)
    mirror = sandbox / "run" / "mirror" / "m"
    (mirror.parent / "keep.txt").parent.mkdir(parents=True, exist_ok=True)
    (mirror.parent / "keep.txt").write_text("keep\n")
    before = _snapshot(sandbox, mirror)
    try:
        names = RemoteRun(store, mirror).pull()
        assert names == ([name] if paths.is_plain_name(name) else [])
        for n in names:
            try:
                fetch(mirror / n, store.url, rank=0, world_size=1)
            except CheckpointError as exc:
                assert "names the unsafe path" in str(exc) and paths.path_problem(rel) is not None
        assert _snapshot(sandbox, mirror) == before  # nothing outside the mirror written or removed
    finally:
        _drop_bucket(store, bucket)
        shutil.rmtree(mirror, ignore_errors=True)


def test_a_prefix_named_dot_dot_is_never_a_checkpoint_and_the_mirror_keeps_its_parent(tmp_path):
    bucket = f"b-{uuid.uuid4().hex[:10]}"
    store = ObjectStore(f"memory://{bucket}/run")
    for name, step in (("..", 9), ("epoch_0_step_1", 1)):
        store.fs.pipe(f"{store.root}/{name}/{layout.METADATA_FILE}", json.dumps({"step": step}).encode())
        store.fs.pipe(f"{store.root}/{name}/{layout.MANIFEST_FILE}", json.dumps({"files": {}, "v": step}).encode())
    parent = tmp_path / "parent"
    (parent / "mirror").mkdir(parents=True)
    (parent / "precious.txt").write_text("keep\n")
    (parent / layout.MANIFEST_FILE).write_text("an older manifest\n")  # what the mirror would compare and remove
    run = RemoteRun(store, parent / "mirror")
    try:
        assert run.pull() == ["epoch_0_step_1"]
        assert run.store.prefixes() == ["epoch_0_step_1"]
        assert (parent / "precious.txt").read_text() == "keep\n"
        assert (parent / layout.MANIFEST_FILE).read_text() == "an older manifest\n"
    finally:
        store.fs.rm(bucket, recursive=True)


@pytest.mark.parametrize("key,expected", [
    ("bkt/run/epoch_0_step_1", ["epoch_0_step_1"]), ("/bkt/run/step=3-loss=0.5", ["step=3-loss=0.5"]),
    ("bkt/run/..", []), ("bkt/run/.", []), ("bkt/run/", []), ("bkt/run//", []), ("bkt/run/a\\b", []),
    ("bkt/run/t\tab", []), ("bkt/other/x", []), ("bkt/run/a/b", []), ("bkt/run/" + "x" * 256, []),
])
def test_listing_names_that_are_not_one_plain_component_are_dropped(key, expected):
    assert plain_names("bkt/run", [key]) == expected


def test_open_regular_refuses_what_is_not_a_regular_file(tmp_path):
    (tmp_path / "f").write_bytes(b"data")
    os.symlink(tmp_path / "f", tmp_path / "link")
    os.mkfifo(tmp_path / "fifo")
    os.close(paths.open_regular(tmp_path / "f"))
    os.close(paths.open_regular(tmp_path / "link", follow=True))
    for name, why in (("link", "a symlink"), ("fifo", "a FIFO")):
        with pytest.raises(OSError, match=why):
            paths.open_regular(tmp_path / name)
    with pytest.raises(OSError, match="a character device"):
        paths.open_regular(Path("/dev/zero"), follow=True)
    with pytest.raises(CheckpointError, match="leads out of"):
        (tmp_path / "ck").mkdir()
        os.symlink(tempfile.gettempdir(), tmp_path / "ck" / "model")
        paths.path_inside(tmp_path / "ck", "model/x", "the manifest")


def test_a_mirror_note_in_a_received_folder_never_chooses_the_bucket_to_fetch_from(tmp_path, monkeypatch):
    """A folder sent by someone else with a mirror's note naming a bucket: the verbs read it as a local folder and
    never fetch from that bucket with the user's credentials; a mirror this process pulled is fetched from."""
    import automodel_ckpt.checkpoint.objectstore as objectstore

    fetched: list[str] = []
    monkeypatch.setattr(objectstore, "fetch", lambda path, url, *a, **k: fetched.append(url))
    received = tmp_path / "received"
    (received / "epoch_0_step_1").mkdir(parents=True)
    (received / layout.OBJECT_STORE_SOURCE).write_text(json.dumps({"url": "s3://attacker/run"}) + "\n")
    objectstore.fetch_collectively(received / "epoch_0_step_1", {"key": "mine"}, rank=0)
    assert fetched == []

    bucket = f"b-{uuid.uuid4().hex[:10]}"
    store = ObjectStore(f"memory://{bucket}/run")
    store.fs.pipe(f"{store.root}/epoch_0_step_1/{layout.MANIFEST_FILE}", json.dumps({"files": {}}).encode())
    try:
        RemoteRun(store, tmp_path / "mirror").pull()
        objectstore.fetch_collectively(tmp_path / "mirror" / "epoch_0_step_1", None, rank=0)
        assert fetched == [store.url]
    finally:
        store.fs.rm(bucket, recursive=True)
