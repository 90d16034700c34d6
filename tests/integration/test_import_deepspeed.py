"""A real DeepSpeed ZeRO-2 and ZeRO-3 run and an HF Trainer run with ``deepspeed=`` (2 CPU ranks, gloo) imported and
continued here on 3 or 1 process: weights and every AdamW moment bitwise, the lr at steps 7-10 its schedule's, the
logits of its model exactly, the losses within 1e-5 of its own continuation."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.integration import deepspeed_run as dsr
from tests.integration import foreign_trainers as ft
from tests.integration import forked_ranks
from tests.integration.harness import CKPT_TRAIN, ckpt_train, env_for, jsonl, run_command

pytest.importorskip("deepspeed")
#: what each DeepSpeed rank imports (DeepSpeed, its ZeRO optimizer check's Muon module, the Trainer), imported once
#: before the ranks fork
DEEPSPEED = ("deepspeed", "deepspeed.runtime.zero.muon.muon_optimizer", "transformers.trainer")
PLAIN = "{_target_: automodel_ckpt.training.lr.constant_after_warmup, warmup_steps: 0}"


@pytest.fixture(scope="module")
def ds_runs(tmp_path_factory, assets):
    """Each stage's run, made when a test first asks for it (its save folder ``ds/``, ``reference.json``,
    ``logits.pt``; ``trainer``, ``trainer-lora``: the HF Trainer's ``trainer/checkpoint-6/`` in place of ``ds/``),
    and the recipe of its rows."""
    folder = tmp_path_factory.mktemp("deepspeed")
    recipe = ft.write_recipe(folder, assets, ft.HF_LINEAR)
    recipe.write_text(recipe.read_text().replace("global_batch_size: 8", f"global_batch_size: {dsr.BATCH}")
                      .replace("local_batch_size: 8", f"local_batch_size: {dsr.BATCH}"))
    runs = {}

    def run(stage: int | str) -> Path:
        if stage not in runs:
            out = folder / f"run_{stage}"
            out.mkdir()
            done = forked_ranks.launch(2, Path(dsr.__file__), str(stage), str(recipe), str(assets), str(out),
                                       env=env_for(assets, {"DS_ACCELERATOR": "cpu"}), preload=DEEPSPEED)
            assert done.returncode == 0, done.stderr[-3000:]
            runs[stage] = out
        return runs[stage]

    return run, recipe


def _deepspeed_own(tag: Path) -> dict[str, dict]:
    """DeepSpeed's own ``zero_to_fp32`` on the test's own files: the fp32 weights, and each moment put together the
    same way (its partitions in the weights' place)."""
    import torch
    from deepspeed.utils import zero_to_fp32 as z

    states = z.parse_model_states(z.get_model_state_files(str(tag)))
    optim = [torch.load(f, weights_only=False)["optimizer_state_dict"] for f in z.get_optim_files(str(tag))]
    stage, world = int(optim[0]["zero_stage"]), len(optim)
    base = "base_optimizer_state" if stage < 3 else "optimizer_state_dict"
    flat = "single_partition_of_fp32_groups" if stage < 3 else "fp32_flat_groups"
    out = {}
    for kind in ("weights", "exp_avg", "exp_avg_sq"):
        groups = [o[flat] if kind == "weights" else [s[kind] for _, s in sorted(o[base]["state"].items())]
                  for o in optim]
        if stage < 3:
            sd = z._get_fp32_state_dict_from_zero2_checkpoint(world, groups, states, False,
                                                              optim[0].get("param_alignment_paddings"))
        else:
            sd = z.to_torch_tensor(z._get_fp32_state_dict_from_zero3_checkpoint(world, groups, states, False))
        out[kind] = {k: v.contiguous() for k, v in sd.items()}
    return out


def _ours(checkpoint: Path) -> tuple[dict, dict]:
    import torch
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    weights = {}
    for shard in sorted((checkpoint / "model").glob("*.safetensors")):
        weights.update(load_file(str(shard)))
    dcp_to_torch_save(str(checkpoint / "optim"), str(checkpoint.parent / "optim.pt"))
    return weights, torch.load(checkpoint.parent / "optim.pt", weights_only=True)["state"]


def _imported_bitwise(tmp_path: Path, assets: Path, source: Path, recipe: Path, logits_file: Path,
                      lora: bool = False) -> str:
    """``ckpt-train import --check`` of ``source`` (its ``global_step6/``, or the folder holding it): the weights and
    every moment bitwise DeepSpeed's own ``zero_to_fp32`` reading of its partitions, the logits round trip exact
    (the source's model's, ``logits_file``; ``lora``: a PEFT model's, the recipe's base under the adapter); the
    import's output. Names are compared without PEFT's adapter segment, as it saves an adapter."""
    import torch

    from automodel_ckpt.interop.check import probe_inputs
    from automodel_ckpt.interop.names import without_adapter as plain

    done = run_command([CKPT_TRAIN, "import", str(source), str(recipe), "--out", "run", "--check"],
                       cwd=tmp_path, env=env_for(assets), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "largest difference 0, bitwise equal" in done.stdout, done.stdout
    checkpoint = tmp_path / "run" / "epoch_0_step_6"
    weights, state = (_plain(d) for d in _ours(checkpoint))
    theirs = {kind: _plain(d) for kind, d in _deepspeed_own(source / "global_step6").items()}
    ft.assert_imported_as_theirs(weights, state, theirs, 6)
    # the logits round trip: the imported weights in the model give the source's model's logits, bitwise
    model = ft.source_model(assets, lora)
    ours = {plain(n): n for n in model.state_dict()}
    model.load_state_dict({ours[k]: v for k, v in weights.items()}, strict=not lora)
    with torch.no_grad():
        logits = model(input_ids=probe_inputs(model.config.vocab_size)).logits
    assert torch.equal(logits, torch.load(logits_file))
    return done.stdout


def _plain(named: dict) -> dict:
    from automodel_ckpt.interop.names import without_adapter

    return {without_adapter(k): v for k, v in named.items()}


def _continued(tmp_path: Path, assets: Path, reference: dict, nproc: int) -> dict[int, dict]:
    """The imported run continued to step 10 on ``nproc`` processes: the lr at steps 7-10 the source's, the losses
    within 1e-5 of its own continuation's; each step's record."""
    args = () if nproc == 1 else ("--step_scheduler.local_batch_size", str(dsr.BATCH // nproc))
    ckpt_train(tmp_path, assets, *args, recipe=tmp_path / "run" / "recipe.yaml", nproc=nproc)
    records = {r["step"]: r for r in jsonl(tmp_path / "run" / "training.jsonl")}
    assert sorted(s for s in records if s > 6) == list(range(7, 11))
    for step in range(7, 11):
        assert records[step]["lr"] == pytest.approx(reference["lr"][str(step)], rel=1e-9), step
    gaps = [abs(records[s]["loss"] - reference["loss"][str(s)]) for s in range(7, 11)]
    print("largest loss difference from the source's own continuation:", max(gaps))  # shown with -s
    assert max(gaps) < 1e-5, (gaps, records, reference)
    return records


@pytest.mark.parametrize("stage,nproc", [(2, 3), (3, 1)])
def test_a_deepspeed_run_continues_here_at_another_world_size(tmp_path, assets, ds_runs, stage, nproc):
    run, recipe = ds_runs
    source = run(stage)
    out = _imported_bitwise(tmp_path, assets, source / "ds", recipe, source / "logits.pt")
    assert f"Imported DeepSpeed ZeRO-{stage} checkpoint (step 6, 2 ranks) as run/epoch_0_step_6" in out
    kind = {2: "one_cycle", 3: "cosine_decay"}[stage]
    assert f"lr_scheduler = {{'_target_': 'automodel_ckpt.training.lr.{kind}'" in out
    _continued(tmp_path, assets, json.loads((source / "reference.json").read_text()), nproc)


def test_an_hf_trainer_run_under_deepspeed_continues_here(tmp_path, assets, ds_runs):
    """The HF Trainer's ``checkpoint-6/`` of a ZeRO-2 run, imported into a recipe that knows nothing of it (another
    schedule and length, one-group AdamW without decay): the Trainer's schedule (not DeepSpeed's: its config has
    none), its two groups and its data position come along, and the run continues as the Trainer resumed does."""
    run, recipe = ds_runs
    source = run("trainer")
    plain = tmp_path / "plain.yaml"
    plain.write_text(re.sub(r"lr_scheduler: .*", f"lr_scheduler: {PLAIN}", recipe.read_text())
                     .replace("max_steps: 10", "max_steps: 40"))
    out = _imported_bitwise(tmp_path, assets, source / "trainer" / "checkpoint-6", plain,
                            source / "logits.pt")
    assert ("Imported DeepSpeed ZeRO-2 checkpoint (step 6, 2 ranks) as run/epoch_0_step_6 (step 6, epoch 0, 72 "
            "samples consumed)") in out
    for line in ("lr_scheduler = {'_target_': 'automodel_ckpt.training.lr.linear_decay', 'warmup_steps': 2}",
                 "step_scheduler.max_steps = 10", f"optimizer.weight_decay = {ft.DECAY}",
                 "optimizer._target_ = automodel_ckpt.training.decay.AdamWNoDecay"):
        assert f"run/recipe.yaml: {line} (the source's)" in out, out
    records = _continued(tmp_path, assets, json.loads((source / "reference.json").read_text()), 1)
    assert records[7]["sample_ids"] == list(range(72, 84))  # the rows the Trainer takes next


def test_an_hf_trainer_lora_run_under_deepspeed_continues_here(tmp_path, assets, ds_runs):
    """A PEFT LoRA run of the HF Trainer under DeepSpeed (ZeRO-2): the Trainer saves it without the frozen base, so
    its partitions and model states hold the adapter alone, its adapter_config.json beside them. The adapter, its
    moments and the Trainer's schedule come along; the base is the recipe's model's."""
    run, recipe = ds_runs
    source = run("trainer-lora")
    lora = tmp_path / "lora.yaml"
    lora.write_text(recipe.read_text() + ft.LORA)
    out = _imported_bitwise(tmp_path, assets, source / "trainer" / "checkpoint-6", lora, source / "logits.pt",
                            lora=True)
    assert "Imported DeepSpeed ZeRO-2 checkpoint (step 6, 2 ranks) as run/epoch_0_step_6 (step 6, epoch 0, 72" in out
    _continued(tmp_path, assets, json.loads((source / "reference.json").read_text()), 1)
