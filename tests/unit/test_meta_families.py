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
