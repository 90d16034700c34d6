"""The folder objects: each property is a path of the layout, each class attribute that file's bare name."""

import os
from pathlib import Path

from automodel_ckpt.ondisk import Archive, CheckpointFolder, HFFolder, ModelFolder, RunFolder, old_sibling, tmp_sibling
from automodel_ckpt.ondisk import layout


def test_a_property_is_a_path_and_the_class_attribute_its_name(tmp_path):
    ckpt = RunFolder(tmp_path).checkpoint("epoch_0_step_3")
    assert ckpt.metadata == tmp_path / "epoch_0_step_3" / layout.METADATA_FILE
    assert CheckpointFolder.metadata == layout.METADATA_FILE
    assert isinstance(ckpt.model, ModelFolder) and ckpt.model.path == tmp_path / "epoch_0_step_3" / layout.MODEL_DIR
    assert ckpt.model.consolidated.config == ckpt.path / "model" / "consolidated" / "config.json"
    assert ckpt.model.hf_metadata.original_tensors.name == layout.ORIGINAL_TENSORS_FILE
    assert HFFolder.adapter_config == "adapter_config.json"
    assert HFFolder.weights_name(1, 2) == "model-00001-of-00002.safetensors"
    assert ckpt.state_file("step_scheduler") == ckpt.path / "step_scheduler.pt"
    assert ckpt.eval_results("addition") == ckpt.path / "eval" / "addition.json"
    assert RunFolder(tmp_path).latest == tmp_path / "LATEST" and RunFolder.latest == "LATEST"
    assert RunFolder.parse_default_name("epoch_2_step_40") == (2, 40) and RunFolder.is_staging(".staging-x")


def test_a_folder_is_path_like(tmp_path):
    folder = HFFolder(tmp_path)
    (folder / "config.json").write_text("{}")
    assert os.fspath(folder) == str(tmp_path) and folder.config.is_file() and folder.is_dir()
    with open(os.path.join(folder, "config.json")) as f:
        assert f.read() == "{}"
    assert folder == HFFolder(tmp_path) and folder != ModelFolder(tmp_path) and len({folder, HFFolder(tmp_path)}) == 1


def test_archives_and_siblings(tmp_path):
    tar = Archive(tmp_path / "model.tar")
    assert tar.eval == tmp_path / "model.eval" and tar.eval_results("t") == tmp_path / "model.eval" / "eval" / "t.json"
    assert Archive.MANIFEST == f"{layout.ARCHIVE_DIR}/{layout.MANIFEST_FILE}"
    assert CheckpointFolder(tmp_path / "ck").archive == tmp_path / "ck.tar"
    assert tmp_sibling(tmp_path / "out.gguf", "ab") == tmp_path / ".out.gguf.tmp-ab"
    assert old_sibling(Path("x/out"), "ab") == Path("x/.out.old-ab")
