"""The mesh keys: sizes that must multiply to the world size, refused strategies, who is who, and the TP plan checks."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from automodel_ckpt.ondisk.metadata import build_metadata, saved_mesh, write_metadata
from automodel_ckpt.cli import main
from automodel_ckpt.distributed.mesh import IMAGE_TEXT_TP_REFUSAL, MeshSizes, ParallelDims, resolve_sizes
from automodel_ckpt.distributed.tensor_parallel import check_tensor_parallel, family_plan
from automodel_ckpt.errors import ConfigError
from tests.unit.cli.test_cli_errors import RECIPE, _error


def _sizes(world_size: int, **keys) -> MeshSizes:
    return resolve_sizes(OmegaConf.create(keys), world_size)


def test_sizes_default_to_data_parallel_over_the_world():
    assert _sizes(4) == MeshSizes(1, 4, 1)
    assert _sizes(4, tp_size=2) == MeshSizes(1, 2, 2)
    assert _sizes(4, dp_replicate_size=2) == MeshSizes(2, 2, 1)
    assert _sizes(8, tp_size=2, dp_size=4, dp_replicate_size=2) == MeshSizes(2, 2, 2)
    assert [m.describe() for m in (MeshSizes(1, 4, 1), MeshSizes(1, 2, 2), MeshSizes(1, 1, 2), MeshSizes(2, 2, 1),
                                   MeshSizes(2, 2, 2), MeshSizes(1, 1, 1))] == [
        "dp 4", "dp 2 × tp 2", "tp 2", "HSDP 2 × 2", "HSDP 2 × 2 × tp 2", "dp 1"]


@pytest.mark.parametrize("world, keys, words", [
    (4, {"tp_size": 2, "dp_size": 4}, "dp_size × tp_size = 4 × 2 = 8 must equal the world size (4)"),
    (4, {"tp_size": 3}, "distributed.tp_size (3) does not divide the world size (4)"),
    (4, {"dp_replicate_size": 3}, "distributed.dp_replicate_size (3) must divide dp_size (4)"),
    (4, {"pp_size": 3}, "distributed.pp_size (3) does not divide the world size (4)"),
    (4, {"pp_size": 2, "tp_size": 2, "sequence_parallel": True}, "sequence parallelism with pipeline stages is not"),
    (4, {"pp_size": 2, "dp_size": 4}, "dp_size × pp_size = 4 × 2 = 8 must equal the world size (4)"),
    (4, {"pp_layers": [2, 2]}, "distributed.pp_layers needs pipeline stages"),
    (4, {"cp_size": 2}, "distributed.cp_size: context parallelism is not supported yet"),
    (4, {"ep_size": 3}, "distributed.ep_size (3) must divide the data-parallel size (4)"),
    (8, {"ep_size": 2, "tp_size": 4}, "distributed.ep_size (2) must be a multiple of tp_size (4)"),
    (8, {"ep_size": 8, "tp_size": 2, "dp_replicate_size": 2}, "distributed.ep_size (8) must divide dp_size / "
                                                              "dp_replicate_size × tp_size (2 × 2)"),
    (8, {"ep_size": 3, "dp_replicate_size": 2}, "distributed.ep_size (3) must divide dp_size / dp_replicate_size (4)"),
    (4, {"sequence_parallel": True}, "distributed.sequence_parallel: true needs tensor parallelism"),
    (4, {"tp_size": 1, "dp_replicate_size": 2, "sequence_parallel": True}, "set distributed.tp_size > 1"),
    (4, {"tp_size": 0}, "distributed.tp_size: expected a positive integer, got 0"),
])
def test_bad_sizes_are_one_line_errors(world, keys, words):
    with pytest.raises(ConfigError) as exc:
        _sizes(world, **keys)
    assert words in str(exc.value) and "\n" not in str(exc.value)


def test_experts_within_pipeline_stages_are_accepted():
    sizes = _sizes(8, pp_size=2, ep_size=2)
    assert sizes == MeshSizes(1, 4, 1, False, 2, 2) and sizes.describe() == "dp 4 × pp 2 × ep 2"


def test_unsupported_sizes_of_one_are_accepted():
    assert _sizes(2, pp_size=1, cp_size=None, ep_size=1) == MeshSizes(1, 2, 1)


def test_sequence_parallel_with_tensor_parallelism_is_accepted():
    sizes = _sizes(4, tp_size=2, sequence_parallel=True)
    assert sizes == MeshSizes(1, 2, 2, True) and sizes.describe() == "dp 2 × tp 2 + SP"
    assert sizes.record() == MeshSizes(1, 2, 2).record()  # a checkpoint's tensors are the same with or without it


def test_sequence_parallel_needs_a_sequence_length_the_tensor_parallel_ranks_divide(capsys):
    keys = ["--step_scheduler.local_batch_size", "16", "--distributed.tp_size", "2",
            "--distributed.sequence_parallel", "true"]
    msg = _error(capsys, ["--nproc-per-node", "4", RECIPE, *keys, "--data.seq_length", "15"])
    assert "data.seq_length (15) must be a multiple of tp_size (2)" in msg and "\n" not in msg.strip()
    assert main(["--nproc-per-node", "4", RECIPE, "--dry-run", *keys]) == 0
    assert "(dp 2 × tp 2 + SP)" in capsys.readouterr().err


def test_cli_refuses_sizes_before_any_process_starts(capsys):
    msg = _error(capsys, ["--nproc-per-node", "2", RECIPE, "--distributed.tp_size", "2", "--distributed.dp_size", "2"])
    assert "dp_size × tp_size = 2 × 2 = 4 must equal the world size (2)" in msg
    assert "pp_size" in _error(capsys, [RECIPE, "--distributed.pp_size", "2"])


def test_batch_arithmetic_uses_the_data_parallel_size(capsys):
    # 64 = 32 × 2 data-parallel ranks on 4 processes with tp 2; on 4 data-parallel ranks it would not divide
    msg = _error(capsys, ["--nproc-per-node", "4", RECIPE, "--step_scheduler.local_batch_size", "24",
                          "--distributed.tp_size", "2"])
    assert "(24 × 2 = 48)" in msg


def test_who_is_who_tensor_parallel_innermost():
    sizes = MeshSizes(2, 2, 2)
    dims = [ParallelDims(sizes, rank) for rank in range(8)]
    assert [d.tp_rank for d in dims] == [0, 1] * 4
    assert [d.dp_rank for d in dims] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [d.writes_rank_state for d in dims] == [True, False] * 4
    assert ParallelDims.single(3, 4).dp_rank == 3 and ParallelDims.single(3, 4).dp_size == 4


def test_checkpoint_metadata_records_the_mesh(tmp_path):
    common = dict(name="c", epoch=0, step=1, train_loss=1.0, val_loss=None, is_final=False, world_size=4,
                  model_save_format="safetensors")
    write_metadata(tmp_path, build_metadata(**common, mesh=MeshSizes(1, 2, 2).record()))
    assert saved_mesh(tmp_path) == MeshSizes(1, 2, 2)
    write_metadata(tmp_path, {k: v for k, v in build_metadata(**common).items() if k != "mesh"})  # older checkpoint
    assert saved_mesh(tmp_path) == MeshSizes(1, 4, 1)


def _model(family: str, **overrides):
    from transformers import AutoModelForCausalLM

    from tests.family_bases import family_config

    config = family_config(family)
    for key, value in overrides.items():
        setattr(config, key, value)
    return AutoModelForCausalLM.from_config(config)


def test_plans_of_the_families():
    llama = family_plan(_model("llama", num_key_value_heads=2))
    assert llama["lm_head"] == "colwise_gather_output" and llama["model.embed_tokens"] == "embedding_rowwise"
    assert llama["model.layers.*.self_attn.q_proj"] == "colwise"
    qwen2 = family_plan(_model("qwen2", num_key_value_heads=2))  # tied: the shared weight stays whole
    assert "lm_head" not in qwen2 and "model.embed_tokens" not in qwen2
    assert qwen2["model.layers.*.mlp.down_proj"] == "rowwise"
    # mixture of experts: the fused experts stay whole (replicated over the tensor-parallel ranks)
    moe = check_tensor_parallel(_model("qwen3_moe", num_attention_heads=4, num_key_value_heads=2), 2)
    assert not [k for k in moe if ".experts" in k] and moe["model.layers.*.self_attn.o_proj"] == "rowwise"
    assert moe["model.layers.*.self_attn.q_norm"] == "replicated_with_grad_allreduce"
    assert not [k for k in check_tensor_parallel(_model("mixtral", num_key_value_heads=2), 2) if ".experts" in k]


@pytest.mark.parametrize("family, overrides, words", [
    ("gpt2", {}, "the model family 'gpt2' has no tensor-parallel plan"),
    ("llama", {}, "distributed.tp_size 2 does not divide num_key_value_heads (1) of the 'llama' model"),
    ("llama", {"num_attention_heads": 1, "num_key_value_heads": 1}, "does not divide num_attention_heads (1)"),
    ("llama", {"num_key_value_heads": 2, "base_model_tp_plan": {"layers.*.mlp.gate_up_proj": "packed_colwise"}},
     "the 'llama' plan uses packed_colwise, not supported yet"),
])
def test_tensor_parallel_refusals_are_one_line(family, overrides, words):
    with pytest.raises(ConfigError) as exc:
        check_tensor_parallel(_model(family, **overrides), 2)
    assert words in str(exc.value) and "\n" not in str(exc.value)


def test_lora_with_tensor_parallelism_is_refused_before_launch(capsys):
    peft_recipe = RECIPE.replace("tiny_llama_sft.yaml", "tiny_llama_peft.yaml")
    msg = _error(capsys, ["--nproc-per-node", "2", peft_recipe, "--distributed.tp_size", "2"])
    assert "LoRA (a peft: section) with tensor parallelism is not supported yet" in msg


@pytest.mark.parametrize("dry_run", [True, False])
def test_an_image_text_model_with_tensor_parallelism_is_refused_before_launch(capsys, dry_run):
    vlm_recipe = RECIPE.replace("tiny_llama_sft.yaml", "tiny_vlm_sft.yaml")
    msg = _error(capsys, ["--nproc-per-node", "2", vlm_recipe, "--distributed.tp_size", "2"]
                 + (["--dry-run"] if dry_run else []))
    assert msg == f"error: {IMAGE_TEXT_TP_REFUSAL}" and "image-text models is not supported yet" in msg


def _config_built(model_config: dict, tokenizer: object) -> list[str]:
    return ["--model.pretrained_model_name_or_path", "null", "--model.embedded", "null",
            "--model.config", json.dumps(model_config), "--tokenizer.pretrained_model_name_or_path", str(tokenizer)]


@pytest.mark.parametrize("model_config, words", [
    ({"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 64},
     "the model family 'gpt2' has no tensor-parallel plan"),
    ({"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
      "num_key_value_heads": 1, "vocab_size": 64}, "does not divide num_key_value_heads (1)"),
])
def test_dry_run_checks_the_family_plan_against_the_model(capsys, tmp_path, model_config, words):
    msg = _error(capsys, ["--nproc-per-node", "2", RECIPE, "--dry-run", "--distributed.tp_size", "2",
                          *_config_built(model_config, tmp_path)])
    assert words in msg


def test_dry_run_says_the_family_plan_applies(capsys, tmp_path):
    llama = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
             "num_key_value_heads": 2, "vocab_size": 64}
    assert main(["--nproc-per-node", "2", RECIPE, "--dry-run", "--distributed.tp_size", "2",
                 *_config_built(llama, tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "# model: the 'llama' tensor-parallel plan applies on tp 2\n" in err and "(tp 2)" in err


def test_dry_run_says_the_mesh(capsys):
    assert main(["--nproc-per-node", "4", RECIPE, "--dry-run", "--step_scheduler.local_batch_size", "16",
                 "--distributed.tp_size", "2"]) == 0
    assert "# valid for 4 process(es) (dp 2 × tp 2); --dry-run: not training" in capsys.readouterr().err


def _kinds(styles: dict) -> dict[str, str]:
    return {name: type(style).__name__ for name, style in styles.items()}


def test_sequence_parallel_styles_follow_the_family_plan():
    from torch.distributed.tensor import Replicate, Shard

    from automodel_ckpt.distributed.tensor_parallel import parallel_styles

    styles = parallel_styles(_model("llama", num_key_value_heads=2), 2, sequence_parallel=True)
    kinds = _kinds(styles)
    for layer in ("model.layers.0", "model.layers.1"):  # every layer, by its path
        assert kinds[f"{layer}.input_layernorm"] == kinds[f"{layer}.post_attention_layernorm"] == "SequenceParallel"
        assert kinds[f"{layer}.self_attn"] == kinds[f"{layer}.mlp"] == "PrepareModuleInput"
    assert kinds["model.norm"] == "SequenceParallel"
    attn, mlp = styles["model.layers.0.self_attn"], styles["model.layers.0.mlp"]
    # the decoder layer passes the attention its hidden states as a keyword, the MLP positionally
    assert attn.input_kwarg_layouts == {"hidden_states": Shard(1)} and attn.input_layouts is None
    assert attn.desired_input_kwarg_layouts == {"hidden_states": Replicate()}
    assert mlp.input_layouts == (Shard(1),) and mlp.desired_input_layouts == (Replicate(),)
    for rowwise in ("model.layers.0.self_attn.o_proj", "model.layers.1.mlp.down_proj", "model.embed_tokens"):
        assert kinds[rowwise] == "RowwiseParallel" and styles[rowwise].output_layouts == (Shard(1),), rowwise
    assert kinds["model.layers.0.self_attn.q_proj"] == "ColwiseParallel"
    assert styles["lm_head"].input_layouts == (Shard(1),) and styles["lm_head"].output_layouts == (Replicate(),)

    tied = _kinds(parallel_styles(_model("qwen2", num_key_value_heads=2), 2, sequence_parallel=True))
    assert tied["model.embed_tokens"] == "PrepareModuleOutput" and tied["lm_head"] == "PrepareModuleInput"
    moe = parallel_styles(_model("qwen3_moe", num_attention_heads=4, num_key_value_heads=2), 2, sequence_parallel=True)
    assert type(moe["model.layers.0.mlp"]).__name__ == "PrepareModuleInputOutput"  # whole experts: gathered, cut
    assert not [k for k in moe if ".experts" in k]
    assert type(moe["model.layers.0.self_attn.q_norm"]).__name__ == "SequenceParallel"  # per-head, as without SP


def test_sequence_parallel_refusals_are_one_line():
    from automodel_ckpt.distributed.tensor_parallel import parallel_styles

    plan = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
            "layers.*.self_attn.v_proj": "colwise"}  # no rowwise projection gives the residual stream back
    with pytest.raises(ConfigError) as exc:
        parallel_styles(_model("llama", num_key_value_heads=2, base_model_tp_plan=plan), 2, sequence_parallel=True)
    assert "distributed.sequence_parallel: the 'llama' model splits model.layers.0.self_attn in a way" in str(exc.value)
    assert "\n" not in str(exc.value)


def test_the_launch_works_the_mesh_out_once():
    """The launcher's huge-page choice, the config check, the dry run's plan check and the recipe's mesh: one
    resolution per process; a size of another type (``True == 1``) is not taken for a cached one."""
    from automodel_ckpt.cli.common import check_recipe
    from automodel_ckpt.cli.train import huge_pages_if_sharded
    from automodel_ckpt.config.loader import load_config
    from automodel_ckpt.config.schema import RecipeConfig
    from automodel_ckpt.config.validate import check_parallel_plans
    from automodel_ckpt.distributed import mesh as mesh_module

    cfg = load_config(RECIPE, ["--distributed.dp_size", "3", "--step_scheduler.global_batch_size", "96"], RecipeConfig)
    mesh_module._resolve.cache_clear()
    huge_pages_if_sharded(cfg, 3)  # replicated: sets nothing
    checked = check_recipe(cfg, 3, inputs=False)
    assert check_parallel_plans(cfg, checked.mesh) == []
    assert resolve_sizes(cfg.distributed, 3) is checked.mesh  # what the recipe's setup asks
    assert mesh_module._resolve.cache_info().misses == 1
    assert checked.mesh == MeshSizes(1, 3, 1)
    with pytest.raises(ConfigError, match="tp_size: expected a positive integer, got True"):
        _sizes(3, tp_size=True, dp_size=3)
