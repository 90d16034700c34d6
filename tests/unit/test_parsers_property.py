"""Every parser of untrusted input, given any bytes or any JSON value, returns a valid result or raises the
project's own error (``CheckpointError`` / ``UserError``): never another exception, never a hang."""

from __future__ import annotations

import json
import pickle
import struct
import tempfile
import warnings
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from automodel_ckpt.ondisk import ModelFolder, bounded, layout, manifest
from automodel_ckpt.ondisk.metadata import read_metadata
from automodel_ckpt.export.hf_metadata import read_hf_metadata
from automodel_ckpt.export.lora_merge import original_dtypes
from automodel_ckpt.ondisk.formats.safe_load import load_dcp_metadata
from automodel_ckpt.ondisk.formats.safetensors_io import header_at, read_header
from automodel_ckpt.checkpoint.objectstore import run
from automodel_ckpt.checkpoint.objectstore.store import plain_names
from automodel_ckpt.errors import UserError

SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=30,
)
deep = st.integers(0, 3000).map(lambda n: "[" * n + "]" * n)
json_texts = json_values.map(json.dumps) | deep | st.text(max_size=200)


_ROOT = tempfile.TemporaryDirectory(prefix="parsers-")  # removed when the tests end


def folder() -> Path:
    return Path(tempfile.mkdtemp(dir=_ROOT.name))


def refused_or(fn, *args):
    """``fn(*args)``, or None when it raised the project's own error."""
    try:
        return fn(*args)
    except UserError:
        return None


@SETTINGS
@given(st.binary(max_size=300) | json_texts.map(str.encode))
def test_any_json_is_parsed_or_refused_in_one_line(data):
    try:
        bounded.parse_json(data, "x", "a test")
    except UserError as exc:
        assert "\n" not in str(exc)


@SETTINGS
@given(json_values | st.dictionaries(st.sampled_from(["files", "manifest_version"]), json_values))
def test_manifest(value):
    ckpt = folder()
    (ckpt / layout.MANIFEST_FILE).write_text(json.dumps(value))
    got = refused_or(manifest.read_manifest, ckpt)
    assert got is None or isinstance(got["files"], dict)
    assert isinstance(manifest.verify_manifest(ckpt, checksums=False), manifest.ManifestReport)


@SETTINGS
@given(json_texts | json_values.map(lambda v: json.dumps({"step": 1, "world_size": v, "mesh": v})))
def test_metadata(text):
    ckpt = folder()
    (ckpt / layout.METADATA_FILE).write_text(text)
    meta = read_metadata(ckpt)
    assert meta is None or isinstance(meta["step"], int)


def safetensors_bytes(header: object, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


entries = st.dictionaries(st.sampled_from(["dtype", "shape", "data_offsets"]),
                          st.sampled_from(["F32", "BF16", "Q1"]) | st.lists(st.integers(-2, 40), max_size=3))
headers = st.dictionaries(st.text(max_size=5), entries, max_size=4)


@SETTINGS
@given(st.binary(max_size=200) | st.builds(safetensors_bytes, headers | json_values, st.binary(max_size=64)))
def test_safetensors_header(data):
    path = folder() / "x.safetensors"
    path.write_bytes(data)
    got = refused_or(read_header, path)
    if got is not None:
        header, start = got
        assert isinstance(header, dict) and start <= len(data)
    with open(path, "rb") as f:
        refused_or(header_at, f.fileno(), str(path))


def dcp_like(value: object) -> bytes:
    return pickle.dumps(value)


@SETTINGS
@given(st.binary(max_size=200) | json_values.map(dcp_like)
       | st.builds(lambda n: b"cbuiltins\nbytearray\n(J" + struct.pack("<i", n) + b"tR.", st.integers(0, 2**31 - 1)))
def test_dcp_metadata(data):
    path = folder() / layout.DCP_METADATA
    path.write_bytes(data)
    got = refused_or(load_dcp_metadata, path)
    assert got is None or isinstance(got.state_dict_metadata, dict)


@SETTINGS
@given(json_values)
def test_tracker_state(value):
    from automodel_ckpt.tracking.tensorboard_backend import TensorBoardBackend
    from automodel_ckpt.tracking.tracker import RunTracker

    tracker = RunTracker(None, folder(), enabled=False, hparams=dict)
    tracker.load_state_dict(value if not isinstance(value, dict) else {"tensorboard": value})
    backend = TensorBoardBackend({})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "kept elsewhere": a new tracked run
        got = refused_or(tracker._reusable, backend, backend.location(tracker.run_dir, "run"), 10)
    assert got is None or isinstance(got, dict)


@SETTINGS
@given(json_values | st.dictionaries(st.just("weight_map"), json_values))
def test_index_json(value):
    from automodel_ckpt.models.hub import _has_all_weights

    base = folder()
    (base / layout.HF_INDEX).write_text(json.dumps(value))
    assert isinstance(_has_all_weights(base), bool)
    got = refused_or(original_dtypes, base)
    assert got is None or isinstance(got, dict)


@SETTINGS
@given(json_values | st.dictionaries(st.sampled_from(["tensors", "num_files", "world_size"]), json_values),
       st.sampled_from([layout.ORIGINAL_TENSORS_FILE, layout.SAVED_STATE_FILE, layout.HF_CONFIG]))
def test_export_metadata(value, name):
    model = folder()
    ModelFolder(model).hf_metadata.path.mkdir()
    (ModelFolder(model).hf_metadata / name).write_text(json.dumps(value))
    meta = refused_or(read_hf_metadata, model)
    if meta is not None and meta.original_num_files is not None:
        assert 0 <= meta.original_num_files <= max(1, len(meta.original or {}))


@SETTINGS
@given(st.lists(st.text(max_size=30), max_size=8),
       st.dictionaries(st.text(max_size=10), st.integers(-5, 10**18), max_size=4),
       st.dictionaries(st.text(max_size=10), st.integers(-5, 10**18), max_size=4))
def test_remote_listings(keys, sizes, listed):
    names = plain_names("bucket/run", keys)
    assert all("/" not in n and n not in ("", ".", "..") for n in names)
    refused_or(run.check_fetch, folder() / "ckpt", "s3://bucket/run/ckpt", sizes, listed)


@pytest.mark.parametrize("levels", [100, 100_000])
def test_deep_nesting_never_reaches_the_recursive_parser(levels):
    with pytest.raises(UserError):
        bounded.parse_json("[" * levels + "]" * levels, "x", "a test")
    assert bounded.parse_json("[" * 64 + "]" * 64, "x", "a test") is not None
