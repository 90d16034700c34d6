"""A meta-built model, materialised and filled from its folder, equals ``from_pretrained`` bit for bit, every family.

Parameters and buffers (rotary tables, ...) alike, tied weights still one tensor: renamed keys, fused experts and
tied heads go through the family's conversion rules in reverse.
"""

from __future__ import annotations

import pytest
import torch

from tests.family_bases import FAMILIES, build_family_base


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_materialised_model_equals_from_pretrained(tmp_path, family):
    from transformers import AutoModelForCausalLM

    from automodel_ckpt.checkpoint.restore.hf_weights import load_hf_weights
    from automodel_ckpt.models.build import build_causal_lm
    from automodel_ckpt.models.materialize import materialize_module

    base = build_family_base(family, tmp_path / family)
    model = build_causal_lm(str(base), on_meta=True)
    assert all(p.device.type == "meta" for p in model.parameters())
    materialize_module(model, "cpu")
    read = load_hf_weights(model, base)
    assert 0 < read <= sum(f.stat().st_size for f in base.glob("*.safetensors"))
    reference = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    ours = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    theirs = dict(reference.named_parameters(remove_duplicate=False)) | dict(reference.named_buffers())
    assert ours.keys() == theirs.keys()
    different = [k for k in theirs if ours[k].dtype != theirs[k].dtype or not torch.equal(ours[k], theirs[k])]
    assert not different, different
    if getattr(reference.config, "tie_word_embeddings", False):
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_fused_expert_parts_fill_any_slice_from_the_parts_it_meets(family):
    """Every on-disk part of a fused expert stack is a box of it; the parts meeting a rank's slice (experts split
    over ranks, or columns) fill exactly that slice of the whole tensor, and the others are not needed."""
    from transformers import AutoModelForCausalLM

    from automodel_ckpt.ondisk.formats.family import disk_layout
    from automodel_ckpt.checkpoint.restore.hf_weights import _box
    from tests.family_bases import family_config

    config = family_config(family)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    layout = disk_layout(config.to_dict(), {k: (s, torch.float32) for k, s in shapes.items()})
    parts: dict[str, list] = {}
    for view in layout.values():
        if not view.is_whole(shapes[view.source]):
            parts.setdefault(view.source, []).append(view)
    assert parts  # the experts are fused in memory, one tensor per expert on disk
    gen = torch.Generator().manual_seed(0)
    for source, views in parts.items():
        whole = torch.randn(shapes[source], generator=gen)
        flat = whole.view(-1)
        on_disk = {v.name: flat.as_strided(v.shape, v.stride, v.offset).clone() for v in views}
        boxes = {v.name: _box(v, shapes[source]) for v in views}
        assert all(b is not None for b in boxes.values()), source
        for dim, of in [(0, 2), (0, 3), (1, 2), (len(whole.shape) - 1, 2)]:  # experts, or the columns, split
            size = -(-whole.shape[dim] // of)
            for k in range(of):
                start = [0] * whole.dim()
                count = list(whole.shape)
                start[dim], count[dim] = k * size, max(0, min(size, whole.shape[dim] - k * size))
                if not count[dim]:
                    continue
                region = (start, count)
                local = torch.full(count, float("nan"))
                met = [name for name, b in boxes.items() if b.meets(region)]
                for name in met:
                    boxes[name].copy_into(local, region, on_disk[name])
                want = whole[tuple(slice(s, s + n) for s, n in zip(start, count))]
                assert torch.equal(local, want), (source, dim, of, k)
                if dim == 0 and of == 2:  # half the experts: half the parts
                    assert len(met) == len(views) // 2, (source, len(met))
