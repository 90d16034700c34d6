"""The export writes what save_pretrained writes, for every family: names, shapes, dtypes, values and file numbers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from automodel_ckpt.ondisk import layout
from automodel_ckpt.export.plan import consolidate
from automodel_ckpt.ondisk.formats.family import disk_layout, family_of
from automodel_ckpt.export.views import flat_boxes
from tests.family_bases import FAMILIES, checkpoint_of, in_memory_state, folder_weights


@pytest.fixture(scope="session")
def bases(family_bases) -> dict[str, Path]:
    return family_bases


def _assert_same_files(expected: dict, actual: dict) -> None:
    extra, missing = set(actual) - set(expected), set(expected) - set(actual)
    assert not extra and not missing, f"extra {extra}, missing {missing}"
    for name, (file, tensor) in expected.items():
        out_file, out = actual[name]
        assert (out_file, out.dtype, out.shape) == (file, tensor.dtype, tensor.shape), name
        assert torch.equal(out.view(torch.uint8), tensor.view(torch.uint8)), name


@pytest.mark.parametrize("fmt", ["safetensors", "torch_save"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_unchanged_weights_export_to_the_base_files_bit_for_bit(bases, family, fmt, tmp_path):
    """lr=0 oracle: same names, file numbers, shapes, dtypes and bytes as the base; the index too."""
    from transformers import AutoModelForCausalLM

    _, model_dir = checkpoint_of(bases[family], tmp_path, fmt)
    out = consolidate(model_dir, progress=False)
    _assert_same_files(folder_weights(bases[family]), folder_weights(out))
    index = json.loads((out / layout.HF_INDEX).read_text())["weight_map"]
    assert index == json.loads((bases[family] / layout.HF_INDEX).read_text())["weight_map"]
    _, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"]
    assert not info["unexpected_keys"] and not info["mismatched_keys"]


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt2", "qwen2"])
def test_trained_weights_export_as_save_pretrained_writes_them(bases, family, tmp_path):
    """With changed weights: the export equals save_pretrained of the model holding them (cast to the base dtype)."""
    model, model_dir = checkpoint_of(bases[family], tmp_path, "safetensors", noise=1e-2)
    out = consolidate(model_dir, progress=False)
    model.to(torch.bfloat16).save_pretrained(tmp_path / "reference")
    expected = {name: ("", t) for name, (_, t) in folder_weights(tmp_path / "reference").items()}
    _assert_same_files(expected, {name: ("", t) for name, (_, t) in folder_weights(out).items()})


def test_column_split_experts_assemble_and_two_ranks_write_the_same_bytes(bases, tmp_path):
    """Pieces that are not runs of the fused expert tensor still export exactly; a 2-process export is identical."""
    _, model_dir = checkpoint_of(bases["mixtral"], tmp_path / "cols", "safetensors", split_dim=1)
    out = consolidate(model_dir, progress=False)
    _assert_same_files(folder_weights(bases["mixtral"]), folder_weights(out))
    _, rows_dir = checkpoint_of(bases["mixtral"], tmp_path / "rows", "safetensors")
    single = consolidate(rows_dir, tmp_path / "single", progress=False)
    consolidate(rows_dir, tmp_path / "multi", rank=1, world_size=2, progress=False)
    multi = consolidate(rows_dir, tmp_path / "multi", rank=0, world_size=2, progress=False)
    files = sorted(p.name for p in single.iterdir())
    assert files == sorted(p.name for p in multi.iterdir())
    assert all((single / f).read_bytes() == (multi / f).read_bytes() for f in files)


def test_layout_names_experts_per_expert_and_drops_tied_copies(bases):
    from transformers import AutoConfig

    def layout_of(family: str) -> dict:
        config = AutoConfig.from_pretrained(bases[family]).to_dict()
        _, state = in_memory_state(bases[family])
        return config, disk_layout(config, {k: (tuple(v.shape), v.dtype) for k, v in state.items()})

    config, mixtral = layout_of("mixtral")
    assert family_of(config) == "mixtral"
    w3 = mixtral["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    assert w3.source == "model.layers.1.mlp.experts.gate_up_proj" and w3.contiguous
    assert w3.offset == (2 * 2 + 1) * 64 * 128  # expert 2, second half of gate_up: (E, 2I, H) = (4, 256, 64)
    _, qwen2 = layout_of("qwen2")
    assert "lm_head.weight" not in qwen2 and "model.embed_tokens.weight" in qwen2
    assert disk_layout({"model_type": "no_such_family"}, {}) is None


def test_flat_boxes_tile_any_range():
    shape = (3, 4, 5)
    for first, end in [(0, 60), (7, 53), (20, 40), (3, 4), (19, 21)]:
        seen = []
        for start, offsets, box in flat_boxes(first, end, shape):
            strides = (20, 5, 1)
            at = sum(o * s for o, s in zip(offsets, strides))
            assert at == first + start
            lead = next((i for i, n in enumerate(box) if n != 1), len(box))
            assert all(box[i] == shape[i] and offsets[i] == 0 for i in range(lead + 1, 3))
            seen.extend(range(at, at + math.prod(box)))
        assert seen == list(range(first, end))


def test_the_base_folders_own_names_decide_prefix_conversions():
    """A LLaVA base stored as on the Hub (``vision_tower.vision_model.*``) exports under those names; one stored as
    transformers 5 writes a model built from its config (``vision_tower.*``) exports under those."""
    from automodel_ckpt.ondisk.formats.family import _meta_model
    from automodel_ckpt.models.tiny_vlm import tiny_llava_config

    config = {**tiny_llava_config(), "model_type": "llava"}
    saved = {k: (tuple(v.shape), v.dtype) for k, v in _meta_model(dict(config)).state_dict().items()}
    plain = sorted(disk_layout(config, saved))
    assert any(n.startswith("vision_tower.embeddings.") for n in plain)
    hub = sorted(n.replace("vision_tower.", "vision_tower.vision_model.", 1) for n in plain)
    assert sorted(disk_layout(config, saved, base_names=hub)) == hub
    assert sorted(disk_layout(config, saved, base_names=plain)) == plain
