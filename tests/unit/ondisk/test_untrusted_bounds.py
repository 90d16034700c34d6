"""Counts, sizes, offsets, shapes and nesting read from untrusted files are checked before they drive any work."""

from __future__ import annotations

import json
import os
import pickle
import struct
import time
from pathlib import Path

import pytest
import torch

from automodel_ckpt.ondisk import ModelFolder, bounded, layout, manifest
from automodel_ckpt.ondisk.metadata import read_metadata
from automodel_ckpt.export import sources
from automodel_ckpt.export.sources import Piece, SourceTensor, check_coverage
from automodel_ckpt.ondisk.formats.safe_load import load_dcp_metadata
from automodel_ckpt.ondisk.formats.safetensors_io import read_header
from automodel_ckpt.config.loader import load_yaml
from automodel_ckpt.errors import CheckpointError, ConfigError


def one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


def deep_json(levels: int) -> str:
    return "[" * levels + "]" * levels


# --- JSON and YAML: size and depth ------------------------------------------------------------------


def test_an_oversized_manifest_is_refused_before_it_is_read(tmp_path):
    file = tmp_path / layout.MANIFEST_FILE
    file.touch()
    os.truncate(file, 80 * 2**20)  # sparse: 80 MiB to stat, nothing to read
    with pytest.raises(CheckpointError) as err:
        manifest.read_manifest(tmp_path)
    assert one_line(err) == f"'{file}' is 80.0 MiB, over the 64.0 MiB limit for a manifest"


def test_deeply_nested_json_is_one_line_not_a_recursion_error(tmp_path):
    (tmp_path / layout.MANIFEST_FILE).write_text(deep_json(200_000))
    with pytest.raises(CheckpointError) as err:
        manifest.read_manifest(tmp_path)
    assert "nests 200000 levels deep, over the limit of 64" in one_line(err)
    (tmp_path / layout.METADATA_FILE).write_text('{"step": 1, "x": ' + deep_json(200_000) + "}")
    assert read_metadata(tmp_path) is None


def test_brackets_inside_strings_do_not_count_as_nesting():
    text = json.dumps({"name": "[" * 1000 + "{" * 1000, "q": 'a\\"[' * 100, "v": [[[1]]]})
    assert bounded.depth_problem(text) is None
    assert bounded.parse_json(text, "x", "a test")["v"] == [[[1]]]
    assert bounded.depth_problem(deep_json(65)) is not None and bounded.depth_problem(deep_json(64)) is None


def test_a_deeply_nested_recipe_is_one_line(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  x: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError) as err:
        load_yaml(recipe)
    assert one_line(err) == f"{recipe}:2: the recipe nests deeper than 64 levels"


def test_a_checkpoint_yaml_nested_too_deeply_is_refused(tmp_path):
    file = tmp_path / "config.yaml"
    file.write_text("a:\n" + "".join("  " * i + f"k{i}:\n" for i in range(1, 80)) + "  " * 80 + "v: 1\n")
    with pytest.raises(CheckpointError) as err:
        bounded.read_yaml(file, "a recipe copy")
    assert "nests deeper than the limit of 64 levels" in one_line(err)


# --- safetensors headers ----------------------------------------------------------------------------


def write_safetensors(path: Path, header: dict, data_len: int, header_len: int | None = None) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + b"\0" * data_len)
    return path


@pytest.mark.parametrize("entries,data_len,message", [
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
      "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}, 24, "the bytes of tensors 'a' and 'b' overlap"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, 8, "its data area holds 8 bytes, its header needs 16"),
    ({"a": {"dtype": "Q7", "shape": [4], "data_offsets": [0, 16]}}, 16, "tensor 'a' has the unknown dtype 'Q7'"),
    ({"a": {"dtype": "F32", "shape": [10**9, 10**9], "data_offsets": [0, 16]}}, 16, "not the 4000000000000000000"),
    ({"a": {"dtype": "F32", "shape": [-4, -1], "data_offsets": [0, 16]}}, 16, "non-negative integers"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [16, 0]}}, 16, "byte range [16, 0)"),
])
def test_a_safetensors_entry_that_does_not_fit_its_file_is_refused(tmp_path, entries, data_len, message):
    path = write_safetensors(tmp_path / "x.safetensors", entries, data_len)
    with pytest.raises(CheckpointError) as err:
        read_header(path)
    assert message in one_line(err) and str(path) in one_line(err)


def test_a_header_length_past_the_file_is_refused(tmp_path):
    path = write_safetensors(tmp_path / "x.safetensors", {}, 0, header_len=50_000_000)
    with pytest.raises(CheckpointError, match="more than the file's 10 bytes"):
        read_header(path)
    path = write_safetensors(tmp_path / "y.safetensors", {}, 0, header_len=2**40)
    with pytest.raises(CheckpointError, match="over safetensors' limit of 100000000 bytes"):
        read_header(path)


def test_overlapping_safetensors_entries_cannot_multiply_an_export(tmp_path):
    """100 entries naming the same bytes would export 100 times the shard's bytes."""
    entries = {f"w{i}": {"dtype": "F32", "shape": [256], "data_offsets": [0, 1024]} for i in range(100)}
    write_safetensors(tmp_path / "model.safetensors", entries, 1024)
    with pytest.raises(CheckpointError, match="overlap"):
        sources.open_source(tmp_path)


# --- DCP metadata: the restricted unpickler ---------------------------------------------------------


def test_a_tiny_pickle_cannot_allocate_gigabytes(tmp_path):
    bomb = tmp_path / ".metadata"
    bomb.write_bytes(b"cbuiltins\nbytearray\n(J\x00\x00\x00\x80tR.")  # bytearray(2**31): 2 GiB
    assert len(bomb.read_bytes()) < 30
    with pytest.raises(CheckpointError) as err:
        load_dcp_metadata(bomb)
    assert "global 'builtins.bytearray' is not allowed" in one_line(err)


def test_constructor_calls_on_one_memoized_list_are_budgeted(tmp_path):
    """torch.Size() of the same memoized 100,000-item tuple, 20,000 times: 2 * 10^9 values from 300 KB."""
    body = b"\x80\x04(" + b"K\x01" * 100_000 + b"t\x94ctorch\nSize\n\x94(" + b"h\x01h\x00\x85R0" * 20_000 + b"N."
    path = tmp_path / ".metadata"
    path.write_bytes(body)
    with pytest.raises(CheckpointError) as err:
        load_dcp_metadata(path)
    assert "constructor calls copy more values than its size allows" in one_line(err)


def test_an_oversized_dcp_metadata_is_refused_before_unpickling(tmp_path, monkeypatch):
    path = tmp_path / ".metadata"
    path.touch()
    os.truncate(path, 5 * 2**30)
    with pytest.raises(CheckpointError, match=r"is 5.0 GiB, over the 4.0 GiB limit for DCP metadata"):
        load_dcp_metadata(path)


def dcp_metadata(size, chunks, storage=None):
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, TensorProperties,
                                                       TensorStorageMetadata)

    md = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(size),
                               [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks])
    return Metadata({"w": md}, storage_data=storage or {})


def test_a_chunk_outside_its_tensor_is_refused(tmp_path):
    path = tmp_path / ".metadata"
    path.write_bytes(pickle.dumps(dcp_metadata([4, 4], [([0, 0], [4, 4]), ([3, 0], [10**12, 4])])))
    with pytest.raises(CheckpointError) as err:
        load_dcp_metadata(path)
    assert "entry 'w' has a chunk outside its size [4, 4]" in one_line(err)


def test_dcp_pieces_sharing_bytes_are_refused(tmp_path):
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    (tmp_path / "__0_0.distcp").write_bytes(b"\0" * 4096)
    storage = {MetadataIndex("w", torch.Size([r, 0])): _StorageInfo("__0_0.distcp", 0, 2048) for r in (0, 2)}
    (tmp_path / layout.DCP_METADATA).write_bytes(
        pickle.dumps(dcp_metadata([4, 4], [([0, 0], [2, 4]), ([2, 0], [2, 4])], storage)))
    with pytest.raises(CheckpointError) as err:
        sources.open_source(tmp_path)
    assert "pieces of 'w' and 'w' share bytes of __0_0.distcp" in one_line(err)


# --- chunk coverage ---------------------------------------------------------------------------------


def grid(rows: int, cols: int, step: int = 2) -> list[Piece]:
    return [Piece(Path(f"f{r}"), (r * step, c * step), (step, step), 0, 0) for r in range(rows) for c in range(cols)]


def test_coverage_of_a_large_grid_is_checked_without_comparing_every_pair():
    tensor = SourceTensor("w", (2 * 300, 2 * 300), torch.float32, grid(300, 300))  # 90,000 pieces
    start = time.process_time()
    check_coverage(tensor, Path("."))
    assert time.process_time() - start < 10  # pairwise: 4 * 10^9 comparisons
    tensor.pieces.append(Piece(Path("x"), (0, 0), (2, 4), 0, 0))
    with pytest.raises(CheckpointError, match="overlapping pieces of 'w'"):
        check_coverage(tensor, Path("."))


def test_many_pieces_that_form_no_grid_are_refused_not_compared_pair_by_pair():
    pieces = [Piece(Path("f"), (i, 0), (2, 1), 0, 0) for i in range(0, 2000)]  # bands overlapping by one row
    with pytest.raises(CheckpointError) as err:
        check_coverage(SourceTensor("w", (2001, 1), torch.float32, pieces), Path("."))
    assert "form no grid" in one_line(err)


def test_a_gap_is_reported_after_the_pieces_are_found_disjoint():
    pieces = [Piece(Path("a"), (0, 0), (2, 4), 0, 0), Piece(Path("b"), (3, 0), (3, 4), 0, 0)]
    with pytest.raises(CheckpointError, match="rows 2..3 of 'w' are in no shard file"):
        check_coverage(SourceTensor("w", (6, 4), torch.float32, pieces), Path("."))


# --- counts that drive file creation ----------------------------------------------------------------


def test_a_small_file_cannot_ask_for_a_billion_output_files(tmp_path):
    from automodel_ckpt.export.hf_metadata import read_hf_metadata

    folder = ModelFolder(tmp_path).hf_metadata.path
    folder.mkdir()
    note = json.dumps({"num_files": 10**9, "tensors": {"w": {"dtype": "F32", "shape": [2], "file": 1}}})
    (folder / layout.ORIGINAL_TENSORS_FILE).write_text(note)
    assert len(note) < 100
    with pytest.raises(CheckpointError) as err:
        read_hf_metadata(tmp_path)
    assert "num_files is 1000000000" in one_line(err) and "from 0 to 1" in one_line(err)


# --- remote manifests -------------------------------------------------------------------------------


def test_remote_sizes_must_match_the_listing_and_fit_the_mirror(tmp_path, monkeypatch):
    from automodel_ckpt.checkpoint.objectstore import run

    folder = tmp_path / "ckpt"
    # a manifest asking for more than the store holds: the object is fetched as it is (the checks after the
    # download report the size mismatch), never a file of the manifest's size; one the listing lacks is not fetched
    assert run.check_fetch(folder, "s3://b/r/ckpt", {"model/a.bin": 10**15, "model/b.bin": 1},
                           {"model/a.bin": 100}) == {"model/a.bin": 100}
    with pytest.raises(CheckpointError) as err:  # a listing asking for more than the manifest: refused
        run.check_fetch(folder, "s3://b/r/ckpt", {"model/a.bin": 100}, {"model/a.bin": 10**15})
    assert one_line(err).startswith("'s3://b/r/ckpt/model/a.bin': manifest.json gives 100 bytes, 1000000000000000")

    class Usage:
        free = 1000

    monkeypatch.setattr(run.shutil, "disk_usage", lambda path: Usage)
    with pytest.raises(CheckpointError) as err:
        run.check_fetch(folder, "s3://b/r/ckpt", {"a": 600, "b": 600}, {"a": 600, "b": 600})
    assert "needs 1.2 KiB in the mirror" in one_line(err) and "1000 B free; nothing was downloaded" in one_line(err)
    run.check_fetch(folder, "s3://b/r/ckpt", {"a": 400, "b": 600}, {"a": 400, "b": 600})


def test_an_oversized_remote_object_is_not_read_whole():
    import fsspec

    from automodel_ckpt.checkpoint.objectstore.store import ObjectStore

    fs = fsspec.filesystem("memory")
    fs.pipe_file("/bounds-bucket/run/.automodel-ckpt-lease.json", b"{" + b" " * (2 * 2**20) + b"}")
    store = ObjectStore("memory://bounds-bucket/run", fs=fs)
    with pytest.raises(CheckpointError, match=r"is 1.0 MiB, over the 1.0 MiB limit"):
        store.read_text(layout.LEASE_OBJECT)
    fs.rm("/bounds-bucket", recursive=True)


# --- verify --export --------------------------------------------------------------------------------


def test_verify_export_checks_the_config_against_the_files_before_building_a_model(tmp_path):
    pytest.importorskip("transformers")
    from automodel_ckpt.export.verify import ExportReport, _config_fits_files

    config = {"model_type": "llama", "hidden_size": 8, "intermediate_size": 16, "num_attention_heads": 2,
              "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": 10}
    (tmp_path / "config.json").write_text(json.dumps(config))
    write_safetensors(tmp_path / "model.safetensors", {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, 16)
    report = ExportReport(tmp_path)
    assert not _config_fits_files(tmp_path, report)
    assert "parameters, the export's files hold 4; not loading it" in report.problems[0]
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 10**9}))
    report = ExportReport(tmp_path)
    assert not _config_fits_files(tmp_path, report)
    assert "num_hidden_layers is 1000000000, more than the 1 tensors" in report.problems[0]
