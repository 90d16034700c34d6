"""`ckpt-train diff`: per-tensor status and numbers, the groups, the JSON object, diff(1)'s exit codes, hostile names."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from automodel_ckpt.cli import main
from automodel_ckpt.evaluation.diff import diff, group


def _llama(folder: Path, seed: int = 0) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(folder)
    return folder


def _edit(src: Path, out: Path, change) -> Path:
    """A copy of ``src`` whose weights ``change(tensors)`` edited in place."""
    shutil.copytree(src, out)
    path = out / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return _llama(tmp_path_factory.mktemp("diff") / "base")


def test_equal_models_exit_0_and_one_change_is_named_with_its_numbers(base, tmp_path, capsys):
    assert main(["diff", str(base), str(base)]) == 0
    assert "Equal: " in capsys.readouterr().out
    name = "model.layers.1.mlp.up_proj.weight"

    def bump(t):
        t[name][0, :4] += 0.5

    other = _edit(base, tmp_path / "other", bump)
    assert main(["diff", str(base), str(other)]) == 1
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("changed"))
    assert name in line and "max|Δ| 0.5" in line
    assert "block 1        1 changed" in out and "block 0" in out and "Different: " in out
    report = diff(base, other)
    d = report.tensors[name]
    numel = load_file(base / "model.safetensors")[name].numel()
    assert d.status == "changed" and d.max_abs == pytest.approx(0.5) and d.changed_fraction == pytest.approx(4 / numel)
    assert all(v.status == "equal" for k, v in report.tensors.items() if k != name)
    assert diff(base, other, tolerance=0.51).tensors[name].status == "close"  # within the tolerance
    assert main(["diff", str(base), str(other), "--tolerance", "0.6"]) == 0


def test_only_one_side_shape_dtype_and_rounding(base, tmp_path):
    def reshape(t):
        t["extra.weight"] = torch.ones(3)
        del t["model.norm.weight"]
        t["model.layers.0.input_layernorm.weight"] = torch.ones(7)

    other = _edit(base, tmp_path / "other", reshape)
    report = diff(base, other)
    assert report.tensors["extra.weight"].status == "only_b" and report.tensors["model.norm.weight"].status == "only_a"
    shape = report.tensors["model.layers.0.input_layernorm.weight"]
    assert shape.status == "changed" and shape.note == "shape [32] -> [7]"

    def to_bf16(t):
        for k in t:
            t[k] = t[k].to(torch.bfloat16)

    rounded = _edit(base, tmp_path / "bf16", to_bf16)
    report = diff(base, rounded)
    assert report.equal and {d.status for d in report.tensors.values()} == {"close"}  # equal once rounded
    assert all(d.note == "dtype float32 -> bfloat16" for d in report.tensors.values())

    def round_and_bump(t):
        to_bf16(t)
        t["lm_head.weight"][0, 0] += 1

    bumped = _edit(base, tmp_path / "bf16_bumped", round_and_bump)
    assert diff(base, bumped).tensors["lm_head.weight"].status == "changed"


def test_json_is_one_object_of_tensors_and_summary(base, tmp_path, capsys):
    other = _edit(base, tmp_path / "other", lambda t: t["lm_head.weight"].mul_(2))
    assert main(["diff", str(base), str(other), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert set(data) >= {"tensors", "summary"}
    assert data["tensors"]["lm_head.weight"]["status"] == "changed"
    assert data["tensors"]["lm_head.weight"]["rel_l2"] == pytest.approx(1.0)
    assert {"status", "max_abs", "rel_l2"} <= set(data["tensors"]["model.norm.weight"])
    assert data["summary"]["equal"] is False and data["summary"]["groups"]["head"] == {"changed": 1}


def test_groups():
    assert group("model.embed_tokens.weight") == "embeddings"
    assert group("model.layers.12.self_attn.q_proj.weight") == "block 12"
    assert group("lm_head.weight") == "head"
    assert group("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight") == "adapters"
    assert group("model.vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight") == "tower"
    assert group("multi_modal_projector.linear_1.weight") == "projector"
    assert group("model.norm.weight") == "other"


def test_errors_exit_2_and_hostile_names_print_escaped(base, tmp_path, capsys):
    assert main(["diff", str(base), str(tmp_path / "missing")]) == 2
    assert "error: " in capsys.readouterr().err
    folder = tmp_path / "not_a_model"
    folder.mkdir()
    (folder / "config.json").write_text("[]")
    save_file({"w": torch.zeros(1)}, folder / "model.safetensors")
    assert main(["diff", str(base), str(folder)]) == 2
    capsys.readouterr()

    def hostile(t):
        t["evil\x1b]0;pwned\x07\n.weight"] = torch.ones(2)

    other = _edit(base, tmp_path / "hostile", hostile)
    assert main(["diff", str(base), str(other)]) == 1
    out = capsys.readouterr().out
    assert "\x1b]" not in out and "\\x1b]0;pwned" in out
