"""`ckpt-train average`: the weighted mean tensor by tensor, the folder transformers loads, refusals in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from automodel_ckpt.cli import main
from automodel_ckpt.errors import UserError
from automodel_ckpt.evaluation.average import average, parse_weights


def _llama(folder: Path, seed: int, hidden: int = 32) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=hidden, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(folder)
    return folder


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.fixture(scope="module")
def three(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("models")
    return [_llama(root / f"m{i}", seed=i) for i in range(3)]


def test_uniform_mean_equals_the_hand_computed_one_and_loads_in_transformers(three, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "avg"
    assert main(["average", *map(str, three), "--out", str(out)]) == 0
    assert "Averaged 3 checkpoints" in capsys.readouterr().out
    got, sources = _tensors(out), [_tensors(p) for p in three]
    assert set(got) == set(sources[0])
    for name, tensor in got.items():
        want = (sources[0][name] + sources[1][name] + sources[2][name]) / 3
        assert tensor.dtype == torch.float32
        torch.testing.assert_close(tensor, want, rtol=1.2e-7, atol=0)  # float32 rounding
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(got)
    model = AutoModelForCausalLM.from_pretrained(out)
    name = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(model.state_dict()[name], got[name])


def test_weights_are_normalized_and_a_zero_weight_drops_a_source(three, tmp_path):
    report = average(three, parse_weights(["3,1", "0"], 3), tmp_path / "w")
    assert report.weights == [0.75, 0.25, 0.0]
    got, a, b = _tensors(tmp_path / "w"), _tensors(three[0]), _tensors(three[1])
    name = "model.embed_tokens.weight"
    torch.testing.assert_close(got[name], (3 * a[name] + b[name]) / 4, rtol=2e-7, atol=1e-8)


def test_a_written_dtype_can_be_chosen(three, tmp_path):
    assert main(["average", str(three[0]), str(three[1]), "--out", str(tmp_path / "b"), "--dtype", "bf16"]) == 0
    assert {t.dtype for t in _tensors(tmp_path / "b").values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "b" / "config.json").read_text())["dtype"] == "bfloat16"


def test_a_model_of_another_shape_is_refused_in_one_line(three, tmp_path, capsys):
    other = _llama(tmp_path / "wide", seed=5, hidden=64)
    capsys.readouterr()
    assert main(["average", str(three[0]), str(other), "--out", str(tmp_path / "x")]) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not the same model" in err and "has shape" in err
    assert not (tmp_path / "x").exists()


def test_bad_weights_and_too_few_sources_are_one_line(three, tmp_path):
    with pytest.raises(UserError, match="2 weight"):
        parse_weights(["1", "2"], 3)
    with pytest.raises(UserError, match=">= 0"):
        parse_weights(["1,-1"], 2)
    with pytest.raises(UserError, match="at least two"):
        average(three[:1], [1.0], tmp_path / "one")


def test_an_existing_output_folder_is_refused(three, tmp_path):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("mine")
    with pytest.raises(UserError, match="not empty"):
        average(three[:2], [1.0, 1.0], tmp_path / "busy")
    assert (tmp_path / "busy" / "x").read_text() == "mine"


def test_adapters_average_into_an_adapter(three, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    adapters = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(three[0]),
                               LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
        model.save_pretrained(tmp_path / f"a{seed}")
        adapters.append(tmp_path / f"a{seed}")
    out = tmp_path / "avg_adapter"
    report = average(adapters, [1.0, 1.0], out)
    assert report.kind == "adapter" and (out / "adapter_config.json").is_file()
    got, a, b = _tensors(out), _tensors(adapters[0]), _tensors(adapters[1])
    assert set(got) == set(a)
    for name in got:
        torch.testing.assert_close(got[name], (a[name] + b[name]) / 2, rtol=1.2e-7, atol=0)
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(three[0]), out)  # PEFT loads it
    with pytest.raises(UserError, match="LoRA adapter"):
        average([adapters[0], three[0]], [1.0, 1.0], tmp_path / "mixed")


def test_a_small_file_linked_out_of_its_folder_is_refused(three, tmp_path):
    import shutil

    planted = tmp_path / "planted"
    shutil.copytree(three[1], planted)
    (tmp_path / "secret").write_text("not a tokenizer")
    (planted / "tokenizer.json").symlink_to(tmp_path / "secret")
    with pytest.raises(UserError, match="is a symlink, not a regular file"):
        average([three[0], planted], [1.0, 1.0], tmp_path / "out")
    assert not (tmp_path / "out").exists()
