"""`ckpt-train diff` against our quantized exports and archives: a GGUF file (by the model's names, through the
export's own mapping) and an int8 folder (dequantized with its scales) are ``close`` to the folder they were exported
from, a real change is still ``changed``, and a truncated GGUF file is one line and exit 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from automodel_ckpt.cli import main
from automodel_ckpt.evaluation.diff import diff
from automodel_ckpt.export.gguf_export import plan_gguf, write_gguf
from automodel_ckpt.export.int8_export import plan_int8, write_int8
from automodel_ckpt.export.model_source import open_model
from automodel_ckpt.models.tiny import ensure_tiny_base

Q_PROJ = "model.layers.0.self_attn.q_proj.weight"  # permuted into llama.cpp's rotary layout in a GGUF


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("diff_quantized")
    base = ensure_tiny_base(root / "base")
    out = {"base": base}
    with open_model(base) as source:
        for kind in ("q8_0", "q4_0", "f16"):
            out[kind] = root / f"model-{kind}.gguf"
            write_gguf(source, plan_gguf(source, kind), out[kind], progress=False)
        for scheme in ("w8a8", "w4a16"):
            out[scheme] = root / scheme
            write_int8(source, plan_int8(source, scheme), out[scheme], progress=False)
    return out


@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "f16", "w8a8", "w4a16"])
def test_an_export_is_close_to_its_source_by_the_source_s_names(exports, kind, capsys):
    report = diff(exports["base"], exports[kind])
    statuses = {d.status for d in report.tensors.values()}
    assert report.equal and statuses <= {"equal", "close"}, {n: d for n, d in report.tensors.items()
                                                             if d.status not in ("equal", "close")}
    assert Q_PROJ in report.tensors and "model.embed_tokens.weight" in report.tensors
    assert set(report.tensors) == set(diff(exports["base"], exports["base"]).tensors)  # the model's own names
    if kind != "f16":  # the quantized weights are not bitwise the source's, and say how they are stored
        assert report.tensors[Q_PROJ].status == "close" and report.tensors[Q_PROJ].max_abs > 0
        assert report.tensors[Q_PROJ].note in ("GGUF Q8_0", "GGUF Q4_0", "int8")
    assert main(["diff", str(exports[kind]), str(exports["base"])]) == 0  # either side
    assert "Equal: " in capsys.readouterr().out


def test_a_changed_weight_is_changed_beside_a_gguf_and_two_ggufs_compare_by_their_names(exports, tmp_path, capsys):
    edited = tmp_path / "edited"
    shutil.copytree(exports["base"], edited)
    weights = next(edited.glob("*.safetensors"))
    tensors = load_file(weights)
    tensors[Q_PROJ][3, :] += 0.25
    save_file(tensors, weights, metadata={"format": "pt"})
    for kind in ("q8_0", "w8a8"):
        report = diff(edited, exports[kind])
        assert report.tensors[Q_PROJ].status == "changed", kind
        assert report.tensors[Q_PROJ].max_abs == pytest.approx(0.25, abs=0.05)
        assert [n for n, d in report.tensors.items() if d.status == "changed"] == [Q_PROJ]
    assert main(["diff", str(exports["q8_0"]), str(exports["q8_0"]), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert "blk.0.attn_q.weight" in data["tensors"] and data["summary"]["equal"] is True
    two = diff(exports["q8_0"], exports["q4_0"])  # within the sum of both files' rounding
    assert two.equal and two.tensors["blk.0.attn_q.weight"].status == "close"
    both = diff(exports["w8a8"], exports["q8_0"])  # an int8 folder beside a GGUF: both steps, by the model's names
    assert both.equal and both.tensors[Q_PROJ].status == "close"


def test_an_archive_is_either_side(exports, tmp_path):
    archive = tmp_path / "base.tar"
    assert main(["pack", str(exports["base"]), "--out", str(archive)]) == 0
    assert diff(archive, exports["base"]).equal and diff(exports["q8_0"], archive).equal


def test_a_truncated_gguf_is_one_line_and_exit_2(exports, tmp_path, capsys):
    cut = tmp_path / "cut.gguf"
    data = exports["q8_0"].read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    assert main(["diff", str(exports["base"]), str(cut)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "truncated" in err and "cut.gguf" in err, err
    cut.write_bytes(data[:20])
    assert main(["diff", str(cut), str(exports["base"])]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not a GGUF file" in err, err
