"""Built-in datasets are written once into the datasets cache and mapped from there, with one fingerprint."""

from __future__ import annotations

import datasets
import pytest

from automodel_ckpt.data.builtin import arithmetic_dataset, chat_task_dataset
from automodel_ckpt.data.generated import kept_on_disk


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf"))
    return tmp_path / "hf" / "automodel_ckpt" / "generated"


def test_made_once_then_mapped_with_the_same_rows_and_fingerprint(cache):
    calls = []

    def make():
        calls.append(1)
        return datasets.Dataset.from_dict({"id": [0, 1, 2], "text": ["a", "b", "c"]})

    first = kept_on_disk("toy", {"n": 3}, make)
    second = kept_on_disk("toy", {"n": 3}, make)
    assert len(calls) == 1 and [p.name.split("-")[0] for p in cache.iterdir()] == ["toy"]
    assert first.cache_files and first.cache_files[0]["filename"] == second.cache_files[0]["filename"]
    assert first._fingerprint == second._fingerprint and second["text"] == ["a", "b", "c"]
    kept_on_disk("toy", {"n": 4}, make)  # other arguments: another file
    assert len(calls) == 2 and len(list(cache.iterdir())) == 2


def test_builtin_rows_are_the_same_from_the_file(cache):
    made = arithmetic_dataset(50, seed=7)
    again = arithmetic_dataset(50, seed=7)
    assert made.to_dict() == again.to_dict() and made.cache_files
    assert chat_task_dataset(5, system="s")["messages"][0][0] == {"role": "system", "content": "s"}


def test_a_cache_that_cannot_be_written_keeps_the_rows_in_memory(tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(blocked))
    ds = arithmetic_dataset(5)
    assert not ds.cache_files and len(ds) == 5
