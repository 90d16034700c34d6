"""The ``.distcp`` folder's ``.metadata``: the same ``Metadata`` torch's writer writes, its body pickled once for
saves of an unchanged layout, pickled afresh when the layout or the write results change."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint import save as dcp_save

from automodel_ckpt.ondisk.formats import sharded

from automodel_ckpt.ondisk.saveplan import plan_results, planning
from automodel_ckpt.ondisk.fastio import metafile
from automodel_ckpt.ondisk.formats.safe_load import load_dcp_metadata


@pytest.fixture(autouse=True)
def _fresh_caches():
    for cache in (planning, plan_results, metafile):
        cache.clear_cache()
    yield
    for cache in (planning, plan_results, metafile):
        cache.clear_cache()


def _state(rows: int = 4) -> dict:
    return {"w": torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3), "b": torch.ones(3),
            "step": torch.tensor(7.0), "lr": 0.5}


def _save(root: Path, step: int, state: dict) -> Path:
    folder = root / f"step_{step}" / "optim"
    folder.mkdir(parents=True)
    sharded._save(state, folder, sharded._writer(folder, sharded.DCP_FILES), None)
    return folder / ".metadata"


def _without_meta(md):
    md.storage_meta = None
    return md


def test_the_file_holds_torchs_metadata_and_the_next_save_reuses_its_body(tmp_path, monkeypatch):
    first = _save(tmp_path, 1, _state())
    pickled = []
    real = metafile.pickle.dumps
    monkeypatch.setattr(metafile.pickle, "dumps", lambda obj, **kw: pickled.append(type(obj).__name__) or real(obj, **kw))
    second = _save(tmp_path, 2, _state())
    assert "Metadata" not in pickled and "dict" in pickled  # the tail only: the body was kept
    torchs_dir = tmp_path / "torch"
    dcp_save(_state(), storage_writer=FileSystemWriter(torchs_dir))
    theirs = load_dcp_metadata(torchs_dir / ".metadata")
    for path, step in ((first, 1), (second, 2)):
        ours = load_dcp_metadata(path)
        with open(path, "rb") as f:
            plain = pickle.load(f)  # noqa: S301 - this test's own file
        assert str(ours.storage_meta.checkpoint_id) == str(path.parent)
        assert plain.storage_meta.save_id == ours.storage_meta.save_id
        assert ours.state_dict_metadata == theirs.state_dict_metadata and ours.version == theirs.version
        assert {k: (v.relative_path, v.length) for k, v in ours.storage_data.items()} == \
            {k: (v.relative_path, v.length) for k, v in _without_meta(plain).storage_data.items()}
    assert load_dcp_metadata(first).storage_meta.save_id != load_dcp_metadata(second).storage_meta.save_id


def test_a_changed_layout_or_result_is_pickled_afresh(tmp_path, monkeypatch):
    _save(tmp_path, 1, _state())
    pickled = []
    real = metafile.pickle.dumps
    monkeypatch.setattr(metafile.pickle, "dumps", lambda obj, **kw: pickled.append(type(obj).__name__) or real(obj, **kw))
    changed = _save(tmp_path, 2, _state(rows=5))
    assert "Metadata" in pickled
    assert load_dcp_metadata(changed).state_dict_metadata["w"].size == torch.Size([5, 3])
    pickled.clear()
    _save(tmp_path, 3, _state(rows=5))
    assert "Metadata" not in pickled
    metafile.clear_cache()  # nothing held: pickled afresh, the same metadata
    again = _save(tmp_path, 4, _state(rows=5))
    assert "Metadata" in pickled
    assert load_dcp_metadata(again).state_dict_metadata == load_dcp_metadata(changed).state_dict_metadata


def test_a_large_file_is_written_past_the_page_cache_and_its_checksum_noted(tmp_path, monkeypatch):
    """From ``DIRECT_MIN`` on the file goes through ``write_file`` (O_DIRECT where the filesystem takes it): the bytes
    are the body then the tail, and the checksum noted is the file's, so the manifest need not read it back."""
    from automodel_ckpt.ondisk import durable, manifest
    from automodel_ckpt.ondisk.fastio import filewrite

    monkeypatch.setattr(filewrite, "DIRECT_MIN", 1 << 16)
    body, end = bytes(range(256)) * 1025, b"tail."  # not a multiple of the page: the last part is written buffered
    written, path = durable.WrittenFiles(), tmp_path / ".metadata"
    metafile.write(path, body, end, sync=True, threads=2, written=written)
    assert path.read_bytes() == body + end and not (tmp_path / ".metadata.tmp").exists()
    known = written.get(path)
    assert known is not None and known.synced
    assert known.digest == manifest.hash_file(path, known.algorithm)[1]
