"""Default LoRA on every family: targets chosen for it; it trains, loads in PEFT and merges to the base layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from automodel_ckpt.ondisk import layout
from automodel_ckpt.ondisk.formats import peft as peft_format
from automodel_ckpt.export.lora_merge import merge_lora
from automodel_ckpt.config.schema import PeftConfig
from automodel_ckpt.models.lora import adapted_modules, apply_lora, lora_summary
from tests.family_bases import FAMILIES

#: What the defaults adapt: PEFT's own per-family defaults where PEFT has one, else every linear layer but the
#: head; mixture-of-experts families attention only.
EXPECTED_TARGETS = {
    "llama": {"q_proj", "v_proj"},
    "qwen2": {"q_proj", "v_proj"},
    "gemma": {"q_proj", "v_proj"},
    "phi3": {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"},
    "gpt2": {"c_attn"},
    "mixtral": {"q_proj", "v_proj"},
    "qwen3_moe": {"q_proj", "k_proj", "v_proj", "o_proj"},
}



def _weights(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        out.update(load_file(path))
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_default_lora_trains_loads_in_peft_and_merges_in_the_base_layout(family_bases, family, tmp_path,
                                                                         process_group):
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    base = family_bases[family]
    torch.manual_seed(0)
    model = apply_lora(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), PeftConfig(rank=4))
    suffixes = {name.rsplit(".", 1)[-1] for name in adapted_modules(model)}
    assert suffixes == EXPECTED_TARGETS[family]
    assert lora_summary(model).startswith(f"LoRA: {family}, ")

    # One optimizer step changes only LoRA weights (B starts at zero, so A gets no gradient on step one).
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    ids = torch.randint(4, 40, (2, 12))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    assert any(n.endswith("lora_B.default.weight") and p.abs().sum() > 0 for n, p in model.named_parameters())

    peft_format.save_adapter(model, tmp_path / "model", rank=0, base_model_path=base)
    loaded = AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "model"), dtype=torch.float32)
    mine = {n: p for n, p in model.named_parameters() if "lora_" in n}
    theirs = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[n], theirs[n]) for n in mine)

    out = merge_lora(tmp_path)
    merged, base_files = _weights(out), _weights(base)
    assert {k: (v.shape, v.dtype) for k, v in merged.items()} == {k: (v.shape, v.dtype) for k, v in base_files.items()}
    assert json.loads((out / layout.HF_CONFIG).read_text())["dtype"] == "bfloat16"
    reference = loaded.merge_and_unload().to(torch.bfloat16)
    reference.save_pretrained(tmp_path / "reference")
    expected = _weights(tmp_path / "reference")
    assert all(torch.equal(merged[k], expected[k]) for k in expected)
    assert any(not torch.equal(merged[k], base_files[k]) for k in base_files)  # the adapter changed something
