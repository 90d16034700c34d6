"""PEFT adapter checkpoints in one process: key names, adapter_config, save/load round trip, LoRA merge."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from automodel_ckpt.ondisk import layout
from automodel_ckpt.ondisk.formats import peft as peft_format
from automodel_ckpt.export.lora_merge import base_model_folder, merge_lora
from automodel_ckpt.config.schema import PeftConfig
from automodel_ckpt.errors import CheckpointError, ConfigError
from automodel_ckpt.models.lora import apply_lora
from automodel_ckpt.models.tiny import TINY_LLAMA_CONFIG, ensure_tiny_base

LAYERS = TINY_LLAMA_CONFIG["num_hidden_layers"]
LORA_DEFAULT_TARGETS = ("q_proj", "v_proj")  # PEFT's own default for Llama, chosen when target_modules is unset
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def _expected_keys(targets=LORA_DEFAULT_TARGETS) -> set[str]:
    return {f"base_model.model.model.layers.{i}.{_PARENT[m]}.{m}.lora_{ab}.weight"
            for i in range(LAYERS) for m in targets for ab in "AB"}


def _lora_model(seed: int = 0, **peft_kwargs) -> torch.nn.Module:
    torch.manual_seed(seed)
    base = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA_CONFIG))
    return apply_lora(base, PeftConfig(**peft_kwargs))



@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_base(tmp_path_factory.mktemp("assets") / "tiny_llama_base")


def test_key_map_is_exactly_what_peft_writes(tmp_path):
    model = _lora_model()
    names = peft_format.trainable_names(model)
    keys = peft_format.peft_key_map(model, names)
    assert set(keys.values()) == _expected_keys()
    assert all(".default." in n for n in names) and not any(".default" in k for k in keys.values())
    model.save_pretrained(tmp_path)  # PEFT's own writer
    with safe_open(str(tmp_path / layout.ADAPTER_WEIGHTS), "pt") as f:
        assert set(f.keys()) == set(keys.values())


def test_only_lora_weights_train():
    model = _lora_model(target_modules=["q_proj", "v_proj"])
    names = peft_format.trainable_names(model)
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert set(peft_format.peft_key_map(model, names).values()) == _expected_keys(("q_proj", "v_proj"))
    assert peft_format.is_peft_model(model)
    assert not peft_format.is_peft_model(LlamaForCausalLM(LlamaConfig(**TINY_LLAMA_CONFIG)))


def test_adapter_config_names_the_absolute_base_folder(tmp_path, monkeypatch):
    from peft import LoraConfig

    monkeypatch.chdir(tmp_path)
    model = _lora_model(rank=4, alpha=8)
    data = peft_format.adapter_config_dict(model, Path("assets/tiny_llama_base"))
    assert data["base_model_name_or_path"] == str(tmp_path.resolve() / "assets" / "tiny_llama_base")
    assert Path(data["base_model_name_or_path"]).is_absolute()
    assert data["r"] == 4 and data["lora_alpha"] == 8 and data["task_type"] == "CAUSAL_LM"
    assert sorted(data["target_modules"]) == sorted(LORA_DEFAULT_TARGETS) and data["inference_mode"] is True
    assert peft_format.adapter_config_dict(model, None)["base_model_name_or_path"] is None
    peft_format.write_adapter_folder(tmp_path / "out", {}, data, automodel_config={})
    loaded = LoraConfig.from_pretrained(str(tmp_path / "out"))
    assert loaded.r == 4 and loaded.base_model_name_or_path == data["base_model_name_or_path"]


def test_save_then_load_restores_the_adapter_exactly(tmp_path, process_group):
    model = _lora_model(init_lora_weights=False)  # random B, so the values matter
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    peft_format.save_adapter(model, tmp_path / "model", rank=0, base_model_path=None,
                             peft_section={"rank": 8})
    files = {p.name for p in (tmp_path / "model").iterdir()}
    assert files == {layout.ADAPTER_CONFIG, layout.ADAPTER_WEIGHTS, layout.PEFT_FULL_CONFIG}
    full = json.loads((tmp_path / "model" / layout.PEFT_FULL_CONFIG).read_text())
    assert full["peft"] == {"rank": 8} and len(full["adapted_modules"]) == LAYERS * len(LORA_DEFAULT_TARGETS)

    other = _lora_model(seed=1, init_lora_weights=False)
    assert not torch.equal(dict(other.named_parameters())[next(iter(before))], next(iter(before.values())))
    frozen = {n: p.detach().clone() for n, p in other.named_parameters() if not p.requires_grad}
    peft_format.load_adapter(other, tmp_path / "model")
    params = dict(other.named_parameters())
    assert all(torch.equal(params[n], t) for n, t in before.items())
    assert all(torch.equal(params[n], t) for n, t in frozen.items())  # the base is untouched


def test_load_refuses_an_adapter_of_another_shape(tmp_path, process_group):
    peft_format.save_adapter(_lora_model(), tmp_path / "model", rank=0)
    with pytest.raises(CheckpointError, match="peft.rank"):
        peft_format.load_adapter(_lora_model(rank=4), tmp_path / "model")
    with pytest.raises(CheckpointError, match="does not fit the model: .*unexpected"):
        peft_format.load_adapter(_lora_model(target_modules=["q_proj"]), tmp_path / "model")


@pytest.mark.parametrize("kwargs, match", [
    ({"rank": 0}, "peft.rank"),
    ({"bias": "some"}, "peft.bias"),
    ({"dropout": 1.0}, "peft.dropout"),
    ({"method": "ia3"}, "peft.method"),
    ({"target_modules": ["qkv_proj"]}, "no module named qkv_proj"),
])
def test_bad_peft_sections_are_one_line_config_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        _lora_model(**kwargs)


def test_merge_writes_the_base_dtype_and_the_merged_weights(tmp_path, base_dir, process_group):
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    model = apply_lora(base, PeftConfig(rank=4, alpha=8, init_lora_weights=False))
    peft_format.save_adapter(model, tmp_path / "model", rank=0, base_model_path=base_dir)
    assert (tmp_path / "model" / "tokenizer_config.json").is_file()  # copied from the base without a tokenizer

    out = merge_lora(tmp_path)  # the checkpoint folder; default output model/merged
    assert out == tmp_path / "model" / layout.MERGED_DIR
    assert json.loads((out / layout.HF_CONFIG).read_text())["dtype"] == "bfloat16"
    assert (out / "tokenizer.json").is_file() and not list(tmp_path.glob("model/.merged.tmp-*"))
    merged = AutoModelForCausalLM.from_pretrained(str(out), dtype=None)
    layer = model.base_model.model.model.layers[1].self_attn.q_proj
    want = layer.base_layer.weight + (8 / 4) * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    got = merged.model.layers[1].self_attn.q_proj.weight
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want.detach().to(torch.bfloat16))
    assert all(p.dtype == torch.bfloat16 for p in merged.parameters())


def test_merge_needs_a_resolvable_base(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / layout.ADAPTER_CONFIG).write_text(json.dumps({"base_model_name_or_path": None}))
    with pytest.raises(CheckpointError, match="names no base model"):
        base_model_folder(tmp_path / "model")
    (tmp_path / "model" / layout.ADAPTER_CONFIG).write_text(json.dumps({"base_model_name_or_path": "/nowhere"}))
    with pytest.raises(CheckpointError, match="'/nowhere' not found"):
        merge_lora(tmp_path)
    (tmp_path / "full").mkdir()
    with pytest.raises(CheckpointError, match="not a PEFT checkpoint"):
        merge_lora(tmp_path / "full")
