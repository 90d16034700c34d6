"""Expert parallelism: the ep sizes and their refusals, and the family's plan applied on the meta device (in one
process, on torch's fake process group of two ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from automodel_ckpt.cli import main
from automodel_ckpt.distributed.expert_parallel import check_expert_parallel
from automodel_ckpt.distributed.mesh import MeshSizes, build_parallel_dims, resolve_sizes
from automodel_ckpt.errors import ConfigError
from tests.family_bases import family_config
from tests.unit.cli.test_cli_errors import RECIPE, _error


def _meta_model(family: str = "qwen3_moe", **changes):
    from transformers import AutoModelForCausalLM

    config = family_config(family)
    for key, value in changes.items():
        setattr(config, key, value)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _fake_ranks(world_size: int):
    """Rank 0 of a fake process group: meshes and DTensors without other processes."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


def test_ep_sizes_describe_and_record():
    sizes = resolve_sizes(OmegaConf.create({"ep_size": 2}), 4)
    assert sizes == MeshSizes(1, 4, 1, ep=2)
    assert sizes.describe() == "dp 4 × ep 2" and not sizes.one_dimensional
    assert sizes.record() == {"dp_replicate": 1, "dp_shard": 4, "tp": 1, "ep": 2}
    assert MeshSizes.from_record(sizes.record(), 4) == sizes
    assert MeshSizes.from_record({"dp_replicate": 1, "dp_shard": 2, "tp": 1}, 2).ep == 1  # records before ep
    assert "ep" not in resolve_sizes(OmegaConf.create({"ep_size": None}), 2).record()
    with_tp = resolve_sizes(OmegaConf.create({"ep_size": 4, "tp_size": 2}), 4)  # an ep group spans tensor-parallel peers
    assert with_tp == MeshSizes(1, 2, 2, ep=4) and with_tp.describe() == "dp 2 × tp 2 × ep 4"


@pytest.mark.parametrize("sizes, expert_dims, local, dense_outer", [
    (MeshSizes(1, 2, 1, ep=2), ("efsdp", "ep"), 2, "dp"),  # each expert whole on one rank
    # HSDP 2 × 4: two copies of each ep group's experts per replica group, FSDP2 splits them in two
    (MeshSizes(2, 4, 1, ep=2), ("dp_replicate", "efsdp", "ep"), 1, "dp_replicate"),
    # tp 2: the experts over the 4 ranks of dp 2 × tp 2, one each; the rest as under tensor parallelism
    (MeshSizes(1, 2, 2, ep=4), ("efsdp", "ep"), 1, "dp_shard"),
])
def test_the_plan_spreads_the_experts_and_fsdp_shards_the_rest(sizes, expert_dims, local, dense_outer):
    from torch.distributed.tensor import DTensor, Shard

    from automodel_ckpt.distributed.fsdp import shard_model

    _fake_ranks(sizes.world_size)
    try:
        model = _meta_model(num_attention_heads=4, num_key_value_heads=2)  # heads tp 2 splits
        names = set(model.state_dict())
        shard_model(model, build_parallel_dims(sizes, 0, "cpu"))
    finally:
        dist.destroy_process_group()
    assert set(model.state_dict()) == names  # whole-model names: the checkpoint and the export need no ep knowledge
    experts = {n: p for n, p in model.named_parameters() if ".mlp.experts." in n}
    assert sorted(experts) == [f"model.layers.{i}.mlp.experts.{w}" for i in range(2) for w in ("down_proj",
                                                                                               "gate_up_proj")]
    for name, p in experts.items():
        assert isinstance(p, DTensor) and p.device_mesh.mesh_dim_names == expert_dims, name
        assert p.placements[-1] == Shard(0) and p.shape[0] == 4 and p.to_local().shape[0] == local, name
    assert all(model.get_submodule(f"model.layers.{i}.mlp.experts").num_experts == 4 // sizes.ep for i in range(2))
    others = [p for n, p in model.named_parameters() if n not in experts]  # FSDP2 over dp (after tp's split, if any)
    assert all(p.device_mesh.mesh_dim_names[0] == dense_outer and Shard(0) in p.placements for p in others)


@pytest.mark.parametrize("family, ep, changes, words", [
    ("llama", 2, {}, "the model family 'llama' has no expert-parallel plan (base_model_ep_plan"),
    ("qwen3_moe", 3, {}, "distributed.ep_size 3 does not divide the 4 experts of the 'qwen3_moe' model"),
    ("mixtral", 8, {}, "distributed.ep_size 8 does not divide the 4 experts of the 'mixtral' model"),
    ("qwen3_moe", 2, {"mlp_only_layers": [0, 1]}, "this 'qwen3_moe' model has no mixture-of-experts layer"),
])
def test_models_the_plan_cannot_spread_are_refused_in_one_line(family, ep, changes, words):
    with pytest.raises(ConfigError) as exc:
        check_expert_parallel(_meta_model(family, **changes), ep)
    assert words in str(exc.value) and "\n" not in str(exc.value)


def test_a_plan_that_leaves_an_expert_weight_whole_is_refused():
    model = _meta_model()
    model._ep_plan = {k: v for k, v in model.ep_plan.items() if not k.endswith("down_proj")}
    with pytest.raises(ConfigError, match=r"the 'qwen3_moe' expert plan leaves down_proj whole in "
                                          r"model\.layers\.0\.mlp\.experts, which expert parallelism cannot split"):
        check_expert_parallel(model, 2)


def test_the_cli_checks_ep_before_launch_and_the_plan_in_dry_run(capsys, tmp_path):
    from tests.family_bases import build_family_base

    base = build_family_base("qwen3_moe", tmp_path / "base", two_files=False)
    dense = build_family_base("llama", tmp_path / "dense", two_files=False)
    capsys.readouterr()
    keys = ["--model.pretrained_model_name_or_path", str(base), "--model.embedded", "null",
            "--step_scheduler.local_batch_size", "8"]
    assert main(["--nproc-per-node", "4", RECIPE, "--dry-run", *keys, "--distributed.ep_size", "2"]) == 0
    err = capsys.readouterr().err
    assert "model: the 'qwen3_moe' expert-parallel plan applies on ep 2 (2 of 4 experts per rank)" in err
    assert "(dp 4 × ep 2)" in err
    msg = _error(capsys, ["--nproc-per-node", "6", RECIPE, "--dry-run", *keys, "--step_scheduler.global_batch_size",
                          "48", "--distributed.ep_size", "3"])
    assert "distributed.ep_size 3 does not divide the 4 experts of the 'qwen3_moe' model" in msg
    assert "distributed.ep_size 2: the model family 'llama' has no expert-parallel plan" in _error(
        capsys, ["--nproc-per-node", "2", RECIPE, "--dry-run", *keys[:1], str(dense), *keys[2:],
                 "--distributed.ep_size", "2"])
