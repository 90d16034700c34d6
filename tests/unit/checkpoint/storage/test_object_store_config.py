"""Object-store locations: a URL never becomes a local path; a bad scheme, backend, bucket or prefix is one line."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from automodel_ckpt.checkpoint import CheckpointConfig
from automodel_ckpt.checkpoint.objectstore import is_url, run_folder
from automodel_ckpt.checkpoint.objectstore.location import local_path, mirror_folder, normalize
from automodel_ckpt.errors import ConfigError


@pytest.mark.parametrize("text,url", [("s3://b/run", True), ("S3://b/run", True), ("gs://b/x", True),
                                      ("checkpoints/", False), ("/abs/path", False), ("file:///tmp/x", False),
                                      ("s3:/b/run", False)])
def test_is_url(text, url):
    assert is_url(text) is url


def test_file_url_is_a_local_path_and_urls_normalize():
    assert local_path("file:///tmp/x") == Path("/tmp/x")
    assert normalize("S3://bucket/run/") == "s3://bucket/run"


def test_s3_checkpoint_dir_never_becomes_a_local_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cfg = CheckpointConfig(checkpoint_dir="s3://bucket/run1")
    folder = run_folder(cfg)
    assert folder.is_absolute() and folder.is_relative_to(tmp_path / "cache") and "s3:" not in folder.parts
    staged = CheckpointConfig(checkpoint_dir="s3://bucket/run1", staging_dir=str(tmp_path / "stage"))
    assert run_folder(staged) == tmp_path / "stage"
    assert mirror_folder("s3://bucket/run1", None) != mirror_folder("s3://bucket/run2", None)
    assert run_folder(CheckpointConfig(checkpoint_dir="ckpts")) == Path("ckpts")


@pytest.mark.parametrize("url,words", [
    ("foo://bucket/run", "unknown storage scheme 'foo://'"),
    ("http://host/run", "unknown storage scheme 'http://'"),
    ("s3://", "names no bucket"),
    ("s3:///run", "names no bucket"),
    ("s3://bucket!/run", "names the bucket 'bucket!', which is no bucket name"),
    ("s3://../run", "names the bucket '..'"),
    ("s3://bucket/run/../other", "names the key prefix 'run/../other' (a '..' component)"),
    ("s3://bucket//run", "(an empty component)"),
    ("gs://bucket/run?", "(a glob character or '::')"),
    ("s3:/bucket/run", "reads as a s3:// URL with a slash missing"),
])
def test_bad_urls_are_one_line_config_errors(url, words):
    with pytest.raises(ConfigError) as err:
        CheckpointConfig(checkpoint_dir=url)
    assert words in str(err.value) and "\n" not in str(err.value)
    assert str(err.value).startswith("checkpoint.checkpoint_dir:")


@pytest.mark.parametrize("scheme,package", [("gs", "gcsfs"), ("az", "adlfs")])
def test_missing_backend_names_the_package(scheme, package):
    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed here")
    with pytest.raises(ConfigError, match=f"pip install {package}"):
        CheckpointConfig(checkpoint_dir=f"{scheme}://bucket/run")


def test_a_glob_of_data_files_keeps_its_glob_characters():
    from automodel_ckpt.checkpoint.locations import check_url

    check_url("s3://bucket/data/*.jsonl", "dataset.paths", pattern=True)
    with pytest.raises(ConfigError, match="no bucket name"):
        check_url("s3://bu cket/data/*.jsonl", "dataset.paths", pattern=True)


def test_restore_from_url_is_checked_too():
    with pytest.raises(ConfigError, match="^checkpoint.restore_from: 'foo://b/x' has an unknown storage scheme"):
        CheckpointConfig(restore_from="foo://b/x")
    assert CheckpointConfig(restore_from="s3://b/run/epoch_0_step_2").restore_from == "s3://b/run/epoch_0_step_2"


@pytest.mark.parametrize("verb", ["inspect", "verify", "plot", "consolidate", "gc"])
def test_verbs_keep_urls_intact(verb):
    """argparse with ``type=Path`` would turn s3://b/run into s3:/b/run: the verbs take the text as given."""
    import importlib

    parser = importlib.import_module(f"automodel_ckpt.cli.{verb}").build_parser()
    args = parser.parse_args(["s3://bucket/run"])
    assert "s3://bucket/run" in [str(v) for v in vars(args).values()]


def test_s3_filesystems_share_the_parsed_service_models_not_the_session(monkeypatch):
    """Each S3 filesystem gets a session of its own (credentials resolved again, a profile honoured) that shares the
    process's loader of botocore's service models: parsed once, not again for every verb, store and reader."""
    pytest.importorskip("s3fs")
    from automodel_ckpt.checkpoint.objectstore.location import open_filesystem

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    opened = [open_filesystem("s3://b/run", {"endpoint_url": "http://127.0.0.1:9"}) for _ in range(2)]
    opened.append(open_filesystem("s3://b/run", {"endpoint_url": "http://127.0.0.1:9", "profile": None}))
    sessions = [fs.session for fs in opened]
    assert len({id(s) for s in sessions}) == 3
    assert len({id(s.get_component("data_loader")) for s in sessions}) == 1
    assert all(fs.kwargs == {} for fs in opened)  # a session option went to the session, not to the client
    given = open_filesystem("s3://b/run", {"endpoint_url": "http://127.0.0.1:9", "session": sessions[0]})
    assert given.session is sessions[0]
