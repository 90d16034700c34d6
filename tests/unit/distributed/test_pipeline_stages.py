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
from automodel_ckpt.ondisk.formats.peft import peft_key_map, trainable_names
from automodel_ckpt.distributed.pipeline import (StageModule, _OneStageAtATime, check_pipeline_model, cut_stage,
                                                 describe_layers, rank_layers, tied_embeddings)
from automodel_ckpt.distributed.tensor_parallel import clip_grad_norm, family_plan
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
    ({"pp_size": 2, "pp_stages_per_rank": 2}, "pp_stages_per_rank (2): several stages per rank need pp_schedule "
                                              "interleaved_1f1b (1f1b runs one stage per rank)"),
    ({"pp_size": 2, "pp_schedule": "interleaved_1f1b", "pp_stages_per_rank": 0}, "pp_stages_per_rank: expected a "
                                                                                  "positive integer, got 0"),
    ({"pp_size": 2, "pp_schedule": "interleaved_1f1b", "pp_microbatches": 5},
     "pp_microbatches (5) must be a multiple of the interleaved schedule's rounds (2 = pp_microbatches // pp_size)"),
    ({"pp_size": 2, "pp_schedule": "interleaved_1f1b", "pp_layers": [2, 2]},
     "pp_layers: expected 4 positive integers (the decoder layers of each stage, pp_size × pp_stages_per_rank = "
     "2 × 2), got [2, 2]"),
    ({"pp_size": 2, "pp_schedule": "interleaved_1f1b", "pp_stages_per_rank": 3},
     "pp_size (2) × pp_stages_per_rank (3) = 6 stages is larger than the model's 4 decoder layers"),
    ({"pp_size": 2, "pp_schedule": "zb"}, "pp_schedule: expected one of 1f1b, gpipe, interleaved_1f1b, got 'zb'"),
    ({"pp_size": 2, "pp_layers": [4]}, "distributed.pp_layers: expected 2 positive integers"),
    ({"pp_size": 2, "pp_layers": [1, 2]}, "pp_layers [1, 2] sum to 3, not the model's 4 decoder layers"),
    ({"pp_size": 4, "dp_size": 1}, "larger than the model's 2 decoder layers"),
])
def test_bad_pipeline_keys_are_one_line_errors(keys, words):
    with pytest.raises(ConfigError) as exc:
        _plan(num_layers=2 if keys.get("pp_size") == 4 else 4, **keys)
    assert words in str(exc.value) and "\n" not in str(exc.value)


def test_interleaved_stages_go_round_the_ranks():
    """Stage ``r + k × pp`` on rank ``r``: pp 2 × 2 stages per rank of 6 layers gives rank 0 layers 0-1 and 4 (of
    the 4 stages 0-1, 2-3, 4, 5), rank 1 layers 2-3 and 5; the lines that name them."""
    plan = _plan(pp_size=2, pp_schedule="interleaved_1f1b", pp_microbatches=4, num_layers=6)
    assert (plan.schedule, plan.stages_per_rank, plan.microbatches) == ("interleaved_1f1b", 2, 4)
    assert plan.rank_stages(1, 2) == [1, 3]
    assert rank_layers(plan, 6, 0, 2) == [range(0, 2), range(4, 5)]
    assert rank_layers(plan, 6, 1, 2) == [range(2, 4), range(5, 6)]
    assert plan.describe() == "interleaved_1f1b, 4 microbatches, 2 stages per rank"
    assert describe_layers(rank_layers(plan, 6, 0, 2)) == "decoder layers 0-1 and 4"
    assert describe_layers([range(3, 4)]) == "decoder layer 3"
    assert describe_layers([range(0, 1), range(2, 3), range(4, 5)]) == "decoder layers 0, 2 and 4"
    three = _plan(pp_size=2, pp_schedule="interleaved_1f1b", pp_stages_per_rank=3, pp_layers=[1, 1, 2, 1, 1, 2],
                  num_layers=8)
    assert rank_layers(three, 8, 1, 2) == [range(1, 2), range(4, 5), range(6, 8)]
    assert _plan(pp_size=2, pp_schedule="gpipe").describe() == "gpipe, 2 microbatches"


def test_interleaved_stages_run_round_the_ranks_give_the_whole_models_logits():
    """Each rank's model holds its stages' layers; each stage runs only its own (the rank's other layers, and the
    norm and head before the model's last stage, pass the hidden states through) and leaves the model as it was."""
    torch.manual_seed(0)
    whole = AutoModelForCausalLM.from_config(LlamaConfig(**TINY_LLAMA_CONFIG))
    plan = _plan(pp_size=2, pp_schedule="interleaved_1f1b")
    ranks = [copy.deepcopy(whole), copy.deepcopy(whole)]
    stages = []
    for rank, model in enumerate(ranks):
        chunks = cut_stage(model, plan, rank, 2)
        assert chunks == [range(rank, rank + 1), range(rank + 2, rank + 3)]
        interleave = _OneStageAtATime(model, chunks, holds_head=rank == 1)
        stages.append([StageModule(model, first=rank == 0 and slot == 0, interleave=interleave, slot=slot)
                       for slot in range(2)])
    ids = torch.randint(0, whole.config.vocab_size, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    before = [dict(m.named_modules()) for m in ranks]
    out = ids
    for stage in range(4):  # stage s on rank s % 2, the rank's (s // 2)-th
        out = stages[stage % 2][stage // 2](out, attention_mask=mask)
        assert out.shape[-1] == (whole.config.vocab_size if stage == 3 else whole.config.hidden_size), stage
    torch.testing.assert_close(out, whole(input_ids=ids, attention_mask=mask).logits)
    assert [dict(m.named_modules()) for m in ranks] == before  # every swapped module is back
    with pytest.raises(Exception):
        stages[1][0](torch.ones(2, 7, 3), attention_mask=mask)  # a failing forward puts them back too
    assert [dict(m.named_modules()) for m in ranks] == before


def test_each_stage_keeps_its_own_whole_model_keys():
    whole = set(_meta_llama().state_dict())
    plan = _plan(pp_size=2, pp_layers=[1, 3])
    stages = []
    for stage in range(2):
        model = _meta_llama()
        assert cut_stage(model, plan, stage, 2) == [plan.stage_layers(4, 2)[stage]]
        stages.append(set(model.state_dict()))
    first, last = stages
    assert first | last == whole and not first & last  # a subset each, every parameter once
    assert {k for k in first if not k.startswith("model.layers.0.")} == {"model.embed_tokens.weight"}
    assert {k for k in last if not k.startswith("model.layers.")} == {"model.norm.weight", "lm_head.weight"}
    assert not any(k.startswith("model.layers.0.") for k in last)


def test_tied_embeddings_are_held_by_the_first_and_the_last_stage_under_the_whole_models_names():
    """A tied Qwen2 on meta: the first stage holds the embedding, the last the head and, tied to it, the embedding
    (both names, as the whole model's state dict reports them); a middle stage neither."""
    from tests.family_bases import family_config

    def qwen2() -> torch.nn.Module:
        config = family_config("qwen2")
        config.num_hidden_layers, config.layer_types = 3, ["full_attention"] * 3
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)

    whole = qwen2()
    assert tied_embeddings(whole) and not tied_embeddings(_meta_llama())
    plan = _plan(pp_size=3, dp_size=1, num_layers=3, world=3, local_batch_size=6)
    stages = []
    for stage in range(3):
        model = qwen2()
        cut_stage(model, plan, stage, 3)
        stages.append(model)
    first, middle, last = (set(m.state_dict()) for m in stages)
    assert first | middle | last == set(whole.state_dict())
    assert first & last == {"model.embed_tokens.weight"} and not middle & (first | last)
    assert {k for k in last if "layers" not in k} == {"model.embed_tokens.weight", "model.norm.weight",
                                                      "lm_head.weight"}
    assert stages[2].lm_head.weight is stages[2].model.embed_tokens.weight  # one parameter: one optimizer state key
    assert [n for n, _ in stages[2].named_parameters() if "layers" not in n] == ["model.embed_tokens.weight",
                                                                              "model.norm.weight"]
    # with tensor parallelism the tied weight stays whole on both stages (the first holds the embedding only)
    assert not {"model.embed_tokens", "lm_head"} & (set(family_plan(stages[0])) | set(family_plan(stages[2])))
    untied = _meta_llama()
    cut_stage(untied, _plan(pp_size=2), 0, 2)
    assert "model.embed_tokens" in family_plan(untied)


@pytest.mark.parametrize("tied", [False, True])
def test_stages_run_in_order_give_the_whole_models_logits_and_gradients(tied):
    """The stages' gradients are the whole model's; a tied weight's is the sum of its two stages' copies."""
    torch.manual_seed(0)
    whole = AutoModelForCausalLM.from_config(LlamaConfig(**TINY_LLAMA_CONFIG | {"tie_word_embeddings": tied}))
    assert tied_embeddings(whole) == tied
    plan = _plan(pp_size=2)
    first, last = copy.deepcopy(whole), copy.deepcopy(whole)
    cut_stage(first, plan, 0, 2)
    cut_stage(last, plan, 1, 2)
    ids = torch.randint(0, whole.config.vocab_size, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding: the mask is applied on every stage
    hidden = StageModule(first, first=True)(ids, attention_mask=mask)
    received = hidden.detach().requires_grad_()
    logits = StageModule(last, first=False)(received, attention_mask=mask)
    expected = whole(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(logits, expected)
    logits.square().sum().backward()
    hidden.backward(received.grad)
    expected.square().sum().backward()
    embed = "model.embed_tokens.weight"
    grads = [dict((n, p.grad) for n, p in m.named_parameters()) for m in (first, last, whole)]
    if tied:
        torch.testing.assert_close(grads[0][embed] + grads[1][embed], grads[2][embed])
    else:
        assert embed not in grads[1]
        torch.testing.assert_close(grads[0][embed], grads[2][embed])
        torch.testing.assert_close(grads[1]["lm_head.weight"], grads[2]["lm_head.weight"])
    torch.testing.assert_close(grads[1]["model.layers.3.mlp.up_proj.weight"],
                               grads[2]["model.layers.3.mlp.up_proj.weight"])


def test_a_tied_copy_left_out_of_the_gradient_norm_is_still_clipped():
    counted, copy_ = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    counted.grad, copy_.grad = torch.tensor([3.0, 4.0]), torch.tensor([3.0, 4.0])
    norm = clip_grad_norm([counted, copy_], 1.0, uncounted=[copy_])
    assert norm.item() == pytest.approx(5.0)  # the tied weight counted once: not sqrt(50)
    torch.testing.assert_close(copy_.grad, counted.grad)
    assert counted.grad.norm().item() == pytest.approx(1.0, rel=1e-5)


def test_lora_stages_keep_whole_model_adapter_names():
    """LoRA wraps the whole model before the cut: each stage holds the adapters of its own modules under the whole
    PEFT model's names, and PEFT names them in the adapter file as it does without stages."""
    from automodel_ckpt.models.lora import apply_lora

    peft = OmegaConf.create({"method": "lora", "rank": 4, "alpha": 8, "dropout": 0.0, "bias": "none",
                             "target_modules": ["q_proj", "down_proj", "lm_head"], "use_rslora": False,
                             "init_lora_weights": True})

    def wrapped() -> torch.nn.Module:
        return apply_lora(_meta_llama(), peft)

    whole = wrapped()
    names = trainable_names(whole)
    file_keys = peft_key_map(whole, names)
    plan = _plan(pp_size=2)
    held = []
    for stage in range(2):
        model = wrapped()
        cut_stage(model, plan, stage, 2)
        mine = trainable_names(model)
        assert set(mine) <= set(names) and set(model.state_dict()) <= set(whole.state_dict())
        assert peft_key_map(model, mine) == {n: file_keys[n] for n in mine}
        held.append(set(mine))
    assert held[0] | held[1] == set(names) and not held[0] & held[1]
    assert "base_model.model.lm_head.lora_A.default.weight" in held[1]
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight" in held[0]


def test_models_the_pipeline_cannot_cut_are_refused():
    sizes = MeshSizes(1, 2, 1, pp=2)
    assert check_pipeline_model(_meta_llama(tie_word_embeddings=True), OmegaConf.create({}), sizes, 8).microbatches == 2
    from transformers import GPT2Config

    with torch.device("meta"):
        gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=2, n_embd=32, n_head=2))
    with pytest.raises(ConfigError, match="'gpt2' model has no decoder-layer list"):
        check_pipeline_model(gpt2, OmegaConf.create({}), sizes, 8)


def test_cli_refuses_pipeline_keys_before_any_process_starts(capsys):
    msg = _error(capsys, ["--nproc-per-node", "4", RECIPE, "--distributed.pp_size", "2",
                          "--distributed.pp_microbatches", "5"])
    assert "pp_microbatches (5) must divide step_scheduler.local_batch_size (32)" in msg
    assert main(["--nproc-per-node", "4", RECIPE, "--dry-run", "--distributed.pp_size", "2"]) == 0
    assert "(dp 2 × pp 2)" in capsys.readouterr().err
    peft = str(Path(RECIPE).with_name("tiny_llama_peft.yaml"))  # LoRA under stages: accepted
    assert main(["--nproc-per-node", "4", peft, "--dry-run", "--distributed.pp_size", "2"]) == 0


def test_dry_run_checks_the_stages_against_the_model(capsys, tmp_path):
    llama = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 2,
             "num_key_value_heads": 2, "vocab_size": 64}
    dry = ["--nproc-per-node", "4", RECIPE, "--dry-run"]
    keys = [*dry, *_config_built(llama, tmp_path)]
    assert main([*keys, "--distributed.pp_size", "2"]) == 0
    assert "# model: 2 pipeline stages of decoder layers 0-1, 2 (1f1b, 2 microbatches)\n" in capsys.readouterr().err
    assert "larger than the model's 3 decoder layers" in _error(capsys, [*keys, "--distributed.pp_size", "4"])
    interleaved = [*keys, "--distributed.pp_size", "2", "--distributed.pp_schedule", "interleaved_1f1b"]
    assert "pp_size (2) × pp_stages_per_rank (2) = 4 stages is larger than the model's 3 decoder layers" in _error(
        capsys, interleaved)
    tied = _config_built(llama | {"tie_word_embeddings": True}, tmp_path)  # accepted: held by two stages
    assert main([*dry, *tied, "--distributed.pp_size", "2"]) == 0
    assert "# model: 2 pipeline stages" in capsys.readouterr().err


def test_dry_run_checks_the_stages_of_an_embedded_base_not_created_yet(capsys, tmp_path, monkeypatch):
    """The default recipe before its first run: the base is built in a temporary folder for the check, and the
    recipe's assets folder stays as it was."""
    monkeypatch.setenv("AUTOMODEL_CKPT_ASSETS", str(tmp_path))
    dry = ["--nproc-per-node", "4", RECIPE, "--dry-run"]
    assert main([*dry, "--distributed.pp_size", "2"]) == 0
    assert "# model: 2 pipeline stages of decoder layers 0-1, 2-3 (1f1b, 2 microbatches)\n" in capsys.readouterr().err
    assert "larger than the model's 4 decoder layers" in _error(capsys, [*dry, "--distributed.pp_size", "2",
                                                                           "--distributed.pp_stages_per_rank", "4",
                                                                           "--distributed.pp_schedule",
                                                                           "interleaved_1f1b"])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("max_norm", [1.0, 1e-3, None])
def test_the_norm_and_the_clipped_gradients_are_torchs_bit_for_bit_and_unclipped_ones_are_left_alone(monkeypatch,
                                                                                                       max_norm):
    """One mesh: torch's ``clip_grad_norm_`` in its two parts, the scaling skipped where its coefficient clamps to 1
    (a multiplication by exactly 1)."""
    torch.manual_seed(0)
    ours, theirs = [torch.nn.Parameter(torch.randn(7, 5)) for _ in range(3)], []
    for p in ours:
        p.grad = torch.randn_like(p) * 0.05
        theirs.append(torch.nn.Parameter(p.detach().clone()))
        theirs[-1].grad = p.grad.clone()
    want = torch.nn.utils.clip_grad_norm_(theirs, max_norm if max_norm else float("inf"))
    scaled = []
    real = torch.nn.utils.clip_grads_with_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grads_with_norm_", lambda *a, **k: scaled.append(1) or real(*a, **k))
    got = clip_grad_norm(ours, max_norm)
    assert torch.equal(got, want)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ours, theirs))
    assert scaled == ([1] if max_norm == 1e-3 else [])  # the norm here is about 0.3
