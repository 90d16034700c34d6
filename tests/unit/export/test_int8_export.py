"""`export --to int8`: a compressed-tensors folder, checked with the library's own config parser and decompressor and
in transformers' compressed-tensors loader (dequantized: the logits of the weights the folder holds).

Bounds: every dequantized weight within half a quantization step of the base's (round to nearest); logits within
5% (w8a8) and 75% (w4a16) of the largest logit of the base for the tiny random model (nearly flat logits; the
benchmark measures what quantization costs a trained model), w8a8 closer than w4a16.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from automodel_ckpt.export.int8_export import plan_int8, write_int8
from automodel_ckpt.export.model_source import open_model
from automodel_ckpt.cli import main
from automodel_ckpt.errors import UserError
from automodel_ckpt.models.tiny import ensure_tiny_base

IDS = torch.tensor([[1, 5, 6, 40, 7, 8, 44, 12, 13, 45, 9]])


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return ensure_tiny_base(tmp_path_factory.mktemp("tiny") / "base")


def export(src: Path, out: Path, scheme: str) -> Path:
    with open_model(src) as source:
        write_int8(source, plan_int8(source, scheme), out, progress=False)
    return out


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


ERRORS: dict[str, float] = {}


@pytest.mark.parametrize("scheme,bound", [("w8a8", 0.05), ("w4a16", 0.75)])
def test_folder_is_what_compressed_tensors_and_transformers_read(base, tmp_path, scheme, bound):
    from compressed_tensors.quantization import QuantizationConfig
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    out = export(base, tmp_path / "int8", scheme)
    config = QuantizationConfig.model_validate(AutoConfig.from_pretrained(out).quantization_config)
    assert config.format == {"w8a8": "int-quantized", "w4a16": "pack-quantized"}[scheme]
    assert config.ignore == ["lm_head"] and config.quant_method == "compressed-tensors"
    reference = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    read = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                quantization_config=CompressedTensorsConfig(dequantize=True))
    with torch.no_grad():
        want, got = reference(IDS).logits, read(IDS).logits
    ERRORS[scheme] = ((want - got).abs().max() / want.abs().max()).item()
    assert ERRORS[scheme] <= bound
    if len(ERRORS) == 2:
        assert ERRORS["w8a8"] < ERRORS["w4a16"]


def test_weights_round_to_nearest_and_the_rest_is_kept_bit_for_bit(base, tmp_path):
    from compressed_tensors.compressors.naive_quantized.base import IntQuantizationCompressor

    out = export(base, tmp_path / "int8", "w8a8")
    with open_model(out) as source:
        plan = plan_int8(source, "w8a8")
    stored, original = _weights(out), _weights(base)
    name = "model.layers.2.mlp.down_proj"
    weight, scale = stored[f"{name}.weight"], stored[f"{name}.weight_scale"]
    assert weight.dtype == torch.int8 and scale.dtype == torch.bfloat16 and scale.shape == (weight.shape[0], 1)
    step = scale.float()
    restored = IntQuantizationCompressor.decompress({"weight": weight, "weight_scale": step}, plan.scheme)["weight"]
    assert ((restored - original[f"{name}.weight"].float()).abs() <= step / 2 + 1e-6).all()
    for kept in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                 "model.layers.0.input_layernorm.weight"):
        assert torch.equal(stored[kept], original[kept]), kept
    assert sum(n.endswith(".weight_scale") for n in stored) == 4 * 7  # q, k, v, o, gate, up, down per layer


def test_cli_dry_run_refusals_and_pack(base, tmp_path, capsys):
    assert main(["export", str(base), "--to", "int8", "--dry-run", "--out", str(tmp_path / "x")]) == 0
    assert "28 linear weights quantized" in capsys.readouterr().out and not (tmp_path / "x").exists()
    assert main(["export", str(base), "--to", "int8", "--calibrate", "8", "--dry-run"]) == 0
    assert "from 8 examples of the tokenizer's own vocabulary" in capsys.readouterr().out
    text = tmp_path / "calib.jsonl"
    text.write_text('{"text": "12+30=42"}\n\n{"text": "7+8=15"}\n')
    assert main(["export", str(base), "--to", "int8", "--calibrate", "8", "--calibration-data", str(text),
                 "--dry-run"]) == 0
    assert f"from 2 examples of '{text}'" in capsys.readouterr().out
    assert main(["export", str(base), "--to", "int8", "--calibration-data", str(text)]) == 2
    assert "give --calibrate too" in capsys.readouterr().err
    assert main(["export", str(base), "--to", "int8", "--scheme", "w4a16", "--calibrate", "8"]) != 0
    assert main(["export", str(base), "--to", "int8", "--scheme", "w2"]) != 0
    assert "unknown int8 scheme 'w2'" in capsys.readouterr().err
    out = tmp_path / "int8"
    assert main(["export", str(base), "--to", "int8", "--out", str(out), "--no-progress"]) == 0
    assert main(["pack", str(out), "--out", str(tmp_path / "int8.tar")]) == 0
    assert main(["verify", str(tmp_path / "int8.tar")]) == 0


def test_a_family_vllm_does_not_load_this_way_is_refused(tmp_path):
    from tests.family_bases import build_family_base

    moe = build_family_base("mixtral", tmp_path / "mixtral", two_files=False)
    with open_model(moe) as source, pytest.raises(UserError, match="does not know the model family 'mixtral'"):
        plan_int8(source, "w8a8")


def test_calibration_gives_each_projection_the_scale_of_its_largest_input(base, tmp_path):
    """Static activation scales: the largest |input| of each projection over the examples, divided by 127."""
    from compressed_tensors.quantization import QuantizationConfig
    from transformers import AutoConfig, AutoModelForCausalLM

    examples = [[1, 5, 6, 41, 7, 8, 44], [1, 12, 13, 41, 9, 9, 44, 14]]
    out = tmp_path / "static"
    with open_model(base) as source:
        write_int8(source, plan_int8(source, "w8a8", examples), out, progress=False)
    config = QuantizationConfig.model_validate(AutoConfig.from_pretrained(out).quantization_config)
    activations = config.config_groups["group_0"].input_activations
    assert activations.dynamic is False and activations.strategy == "tensor"
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    seen: dict[str, float] = {}
    module = model.model.layers[1].mlp.down_proj
    module.register_forward_pre_hook(lambda m, args: seen.__setitem__("x", max(seen.get("x", 0.0),
                                                                                float(args[0].abs().max()))))
    with torch.no_grad():
        for ids in examples:
            model(torch.tensor([ids]))
    stored = _weights(out)["model.layers.1.mlp.down_proj.input_scale"]
    assert stored.shape == (1,) and stored.dtype == torch.bfloat16
    assert stored.item() == pytest.approx(seen["x"] / 127, rel=1e-2)  # stored in bf16
    assert sum(n.endswith(".input_scale") for n in _weights(out)) == 28
