"""`eval` and `average` read a checkpoint's tensors as the export gives them: the saved values in the base's dtype."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from automodel_ckpt.evaluation.average import average
from automodel_ckpt.evaluation.harness import load_model
from automodel_ckpt.evaluation.tensors import open_tensors
from tests.family_bases import build_family_base, checkpoint_of


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[list[Path], list[dict[str, torch.Tensor]]]:
    """Two checkpoints (2-rank safetensors shards, DCP) of a bf16 base, trained (perturbed) and saved in float32."""
    root = tmp_path_factory.mktemp("dtype")
    base = build_family_base("llama", root / "base")
    checkpoints, states = [], []
    for i, fmt in enumerate(("safetensors", "dcp")):
        model, model_dir = checkpoint_of(base, root / f"run{i}", fmt, noise=1e-2 * (i + 1))
        checkpoints.append(model_dir.parent)
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return checkpoints, states


def test_the_tensors_are_the_saved_values_in_the_bases_dtype(saved):
    checkpoints, states = saved
    for checkpoint, state in zip(checkpoints, states):
        assert {t.dtype for t in state.values()} == {torch.float32}  # as saved
        with open_tensors(checkpoint) as tensors:
            assert set(tensors.dtypes.values()) == {torch.bfloat16}  # the base's
            for name in ("model.layers.0.mlp.up_proj.weight", "model.norm.weight"):
                got = tensors.read(name)
                assert got.dtype == torch.bfloat16 and torch.equal(got, state[name].to(torch.bfloat16)), name


def test_eval_scores_the_model_in_the_bases_dtype(saved):
    checkpoints, states = saved
    with load_model(checkpoints[0]) as (model, _):
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
        name = "model.layers.1.self_attn.q_proj.weight"
        assert torch.equal(model.state_dict()[name], states[0][name].to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [None, torch.float32])
def test_average_means_the_saved_float32_values_and_writes_the_bases_dtype(saved, tmp_path, dtype):
    checkpoints, states = saved
    report = average(checkpoints, [1.0, 3.0], tmp_path / "avg", dtype=dtype)
    assert report.tensors == len(states[0])
    with safe_open(str(next((tmp_path / "avg").glob("*.safetensors"))), framework="pt") as f:
        got = {k: f.get_tensor(k) for k in f.keys()}
    for name, tensor in got.items():
        # each source's tensor as saved (float32, not cast to the base's bf16 first), the mean in float32
        want = states[0][name] * 0.25 + states[1][name] * 0.75
        if dtype is None:  # written in the base's dtype
            assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, want.to(torch.bfloat16)), name
        else:
            assert tensor.dtype == torch.float32, name
            torch.testing.assert_close(tensor, want, rtol=1.2e-7, atol=0)
