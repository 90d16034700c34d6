"""Pipeline keys and stages: sizes and names of the mesh, one-line refusals, which whole-model keys each stage keeps,
and the stages run in order giving the whole model's logits."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, LlamaConfig

from automodel_ckpt.cli import main
from automodel_ckpt.distributed.mesh import MeshSizes, ParallelDims, resolve_pipeline, resolve_sizes
from automodel_ckpt.distributed.pipeline import StageModule, check_pipeline_model, cut_stage
from automodel_ckpt.errors import ConfigError
from automodel_ckpt.models.tiny import TINY_LLAMA_CONFIG
from tests.unit.cli.test_cli_errors import RECIPE, _error
from tests.unit.distributed.test_parallel_dims import _config_built


def _plan(world: int = 4, local_batch_size: int = 8, num_layers: int | None = 4, **keys):
    section = OmegaConf.create(keys)
    return resolve_pipeline(section, resolve_sizes(section, world), local_batch_size, num_layers)


def _meta_llama(**overrides) -> torch.nn.Module:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(LlamaConfig(**(TINY_LLAMA_CONFIG | overrides)))


def test_the_pipeline_is_outermost_and_keeps_data_parallel_ranks():
    sizes = resolve_sizes(OmegaConf.create({"pp_size": 2}), 4)
    assert sizes == MeshSizes(1, 2, 1, pp=2) and sizes.world_size == 4
    assert [MeshSizes(1, 2, 1, pp=2).describe(), MeshSizes(1, 1, 1, pp=4).describe(),
            MeshSizes(1, 1, 2, pp=2).describe()] == ["dp 2 × pp 2", "pp 4", "pp 2 × tp 2"]
    tp = [ParallelDims(MeshSizes(1, 1, 2, pp=2), r) for r in range(4)]
    assert [(d.pp_rank, d.dp_rank, d.tp_rank, d.writes_rank_state) for d in tp] == [
        (0, 0, 0, True), (0, 0, 1, False), (1, 0, 0, False), (1, 0, 1, False)]
    assert sizes.record() == {"dp_replicate": 1, "dp_shard": 2, "tp": 1, "pp": 2}
    assert MeshSizes.from_record(sizes.record(), 4) == sizes
    assert MeshSizes.from_record({"dp_replicate": 1, "dp_shard": 4, "tp": 1}, 4).pp == 1  # written before pp
    ranks = [ParallelDims(sizes, r) for r in range(4)]
    assert [(d.pp_rank, d.dp_rank) for d in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [d.writes_rank_state for d in ranks] == [True, True, False, False]


def test_plan_defaults_and_even_split():
    plan = _plan(pp_size=2)
    assert (plan.schedule, plan.microbatches, plan.layers) == ("1f1b", 2, None)
    assert plan.stage_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert _plan(pp_size=2, pp_layers=[1, 3]).stage_layers(4, 2) == [range(0, 1), range(1, 4)]


@pytest.mark.parametrize("keys, words", [
    ({"pp_size": 2, "pp_microbatches": 3}, "pp_microbatches (3) must divide step_scheduler.local_batch_size (8)"),
    ({"pp_size": 4, "pp_microbatches": 2}, "must be at least pp_size (4) with the 1f1b schedule"),
    ({"pp_size": 2, "pp_schedule": "interleaved_1f1b"}, "interleaved_1f1b (several stages per rank"),
    ({"pp_size": 2, "pp_schedule": "zb"}, "distributed.pp_schedule: expected one of 1f1b, gpipe, got 'zb'"),
    ({"pp_size": 2, "pp_layers": [4]}, "distributed.pp_layers: expected 2 positive integers"),
    ({"pp_size": 2, "pp_layers": [1, 2]}, "pp_layers [1, 2] sum to 3, not the model's 4 decoder layers"),
    ({"pp_size": 4, "dp_size": 1}, "larger than the model's 2 decoder layers"),
])
def test_bad_pipeline_keys_are_one_line_errors(keys, words):
    with pytest.raises(ConfigError) as exc:
        _plan(num_layers=2 if keys.get("pp_size") == 4 else 4, **keys)
    assert words in str(exc.value) and "\n" not in str(exc.value)


def test_each_stage_keeps_its_own_whole_model_keys():
    whole = set(_meta_llama().state_dict())
    plan = _plan(pp_size=2, pp_layers=[1, 3])
    stages = []
    for stage in range(2):
        model = _meta_llama()
        assert cut_stage(model, plan, stage, 2) == plan.stage_layers(4, 2)[stage]
        stages.append(set(model.state_dict()))
    first, last = stages
    assert first | last == whole and not first & last  # a subset each, every parameter once
    assert {k for k in first if not k.startswith("model.layers.0.")} == {"model.embed_tokens.weight"}
    assert {k for k in last if not k.startswith("model.layers.")} == {"model.norm.weight", "lm_head.weight"}
    assert not any(k.startswith("model.layers.0.") for k in last)


def test_stages_run_in_order_give_the_whole_models_logits():
    torch.manual_seed(0)
    whole = AutoModelForCausalLM.from_config(LlamaConfig(**TINY_LLAMA_CONFIG)).eval()
    plan = _plan(pp_size=2)
    first, last = copy.deepcopy(whole), copy.deepcopy(whole)
    cut_stage(first, plan, 0, 2)
    cut_stage(last, plan, 1, 2)
    ids = torch.randint(0, whole.config.vocab_size, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding: the mask is applied on every stage
    with torch.no_grad():
        hidden = StageModule(first, first=True)(ids, attention_mask=mask)
        logits = StageModule(last, first=False)(hidden, attention_mask=mask)
        torch.testing.assert_close(logits, whole(input_ids=ids, attention_mask=mask).logits)


def test_models_the_pipeline_cannot_cut_are_refused():
    sizes = MeshSizes(1, 2, 1, pp=2)
    with pytest.raises(ConfigError, match="ties its head to its input embedding"):
        check_pipeline_model(_meta_llama(tie_word_embeddings=True), OmegaConf.create({}), sizes, 8)
    from transformers import GPT2Config

    with torch.device("meta"):
        gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=2, n_embd=32, n_head=2))
    with pytest.raises(ConfigError, match="'gpt2' model has no decoder-layer list"):
        check_pipeline_model(gpt2, OmegaConf.create({}), sizes, 8)


def test_cli_refuses_pipeline_keys_before_any_process_starts(capsys):
    msg = _error(capsys, ["--nproc-per-node", "4", RECIPE, "--distributed.pp_size", "2",
                          "--distributed.pp_microbatches", "5"])
    assert "pp_microbatches (5) must divide step_scheduler.local_batch_size (32)" in msg
    msg = _error(capsys, ["--nproc-per-node", "4", str(Path(RECIPE).with_name("tiny_llama_peft.yaml")),
                          "--distributed.pp_size", "2"])
    assert "LoRA (a peft: section) with pipeline parallelism is not supported yet" in msg
    assert main(["--nproc-per-node", "4", RECIPE, "--dry-run", "--distributed.pp_size", "2"]) == 0
    assert "(dp 2 × pp 2)" in capsys.readouterr().err


def test_dry_run_checks_the_stages_against_the_model(capsys, tmp_path):
    llama = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 2,
             "num_key_value_heads": 2, "vocab_size": 64}
    dry = ["--nproc-per-node", "4", RECIPE, "--dry-run"]
    keys = [*dry, *_config_built(llama, tmp_path)]
    assert main([*keys, "--distributed.pp_size", "2"]) == 0
    assert "# model: 2 pipeline stages of decoder layers 0-1, 2-2 (1f1b, 2 microbatches)\n" in capsys.readouterr().err
    assert "larger than the model's 3 decoder layers" in _error(capsys, [*keys, "--distributed.pp_size", "4"])
    tied = _config_built(llama | {"tie_word_embeddings": True}, tmp_path)
    assert "ties its head" in _error(capsys, [*dry, *tied, "--distributed.pp_size", "2"])
