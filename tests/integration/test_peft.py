"""LoRA runs end to end: an HF PEFT adapter folder per checkpoint, loadable offline, mergeable, exactly resumable.

Four short 2-process runs of recipes/tiny_llama_peft.yaml, shared by the tests: 8 steps straight; 4 then 8 steps
with model_save_format torch_save (the adapter format is kept, with a warning); 8 steps restored from the straight
run's step-4 checkpoint through checkpoint.restore_from. Under pipeline stages (pp 2): 4 steps, and step 5 resumed
from the straight run's step-4 checkpoint.
"""

from __future__ import annotations

import json
import os
import sys
from functools import cache
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open

from automodel_ckpt.ondisk import layout
from tests.integration.harness import CKPT_TRAIN, REPO, ckpt_train, env_for, jsonl, losses, run_command, tree

PEFT_RECIPE = REPO / "recipes" / "tiny_llama_peft.yaml"
COMMON = ("--step_scheduler.ckpt_every_steps", "4", "--data.val_size", "64")
ADAPTER_FILES = {layout.ADAPTER_CONFIG, layout.ADAPTER_WEIGHTS, layout.PEFT_FULL_CONFIG}
FALLBACK_WARNING = "checkpoint.model_save_format=torch_save does not apply to PEFT models"


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("peft")


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """Everything here must load without a hub: local paths only."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def _train(work: Path, assets: Path, run_dir: str, steps: int, *extra: str):
    return ckpt_train(work, assets, *COMMON, "--checkpoint.checkpoint_dir", run_dir,
                      "--step_scheduler.max_steps", str(steps), *extra, nproc=2, recipe=PEFT_RECIPE)


@cache
def _straight(work: Path, assets: Path) -> Path:
    _train(work, assets, "straight", 8)
    return work / "straight"


@cache
def _resumed_torch_save(work: Path, assets: Path) -> tuple[Path, str, str]:
    first = _train(work, assets, "resumed", 4, "--checkpoint.model_save_format", "torch_save")
    second = _train(work, assets, "resumed", 8, "--checkpoint.model_save_format", "torch_save")
    return work / "resumed", first.output, second.output


@cache
def _restored(work: Path, assets: Path) -> tuple[Path, str]:
    source = _straight(work, assets) / "epoch_0_step_4"
    result = _train(work, assets, "restored", 8, "--checkpoint.restore_from", str(source))
    return work / "restored", result.output


def _targets() -> list[str]:
    return yaml.safe_load(PEFT_RECIPE.read_text())["peft"].get("target_modules") or ["q_proj", "v_proj"]


def _expected_adapter_keys(assets: Path) -> set[str]:
    """PEFT's names for every adapted module of the base, found from the base's own module names."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(assets / "tiny_llama_base")
    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(config)
    targets = set(_targets())
    modules = [name for name, _ in base.named_modules() if name.rsplit(".", 1)[-1] in targets]
    return {f"base_model.model.{m}.lora_{ab}.weight" for m in modules for ab in "AB"}


def _model_dir(run: Path, step: int = 8) -> Path:
    return run / f"epoch_0_step_{step}" / layout.MODEL_DIR


# ------------------------------------------------------------------------------------------ layout


def test_checkpoint_model_folder_is_a_peft_adapter(work, assets):
    run = _straight(work, assets)
    expected_top = {"config.yaml", "losses.json", "metadata.json", "manifest.json", "step_scheduler.pt",
                    "lr_scheduler.pt", "optim/.metadata"}
    for r in range(2):
        expected_top |= {f"optim/__{r}_0.distcp", f"dataloader/dataloader_dp_rank_{r}.pt", f"rng/rng_dp_rank_{r}.pt"}
    for step in (4, 8):
        files = tree(run / f"epoch_0_step_{step}")
        model_files = {f.split("/", 1)[1] for f in files if f.startswith("model/")}
        assert files - {f"model/{f}" for f in model_files} == expected_top
        tokenizer_files = model_files - ADAPTER_FILES
        assert ADAPTER_FILES <= model_files  # no shards, no consolidate.sh, no .hf_metadata, no consolidated/
        assert "tokenizer_config.json" in tokenizer_files and tokenizer_files <= set(layout.HF_TOKENIZER_FILES)
    config = json.loads((_model_dir(run) / layout.ADAPTER_CONFIG).read_text())
    base = Path(config["base_model_name_or_path"])
    assert base.is_absolute() and base == (assets / "tiny_llama_base").resolve()
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    full = json.loads((_model_dir(run) / layout.PEFT_FULL_CONFIG).read_text())
    assert full["peft"] == yaml.safe_load((run / "epoch_0_step_8" / "config.yaml").read_text())["peft"]
    verify = run_command([CKPT_TRAIN, "verify", str(run / "epoch_0_step_8")], env=env_for(assets), timeout=300)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert json.loads((run / "epoch_0_step_8" / "metadata.json").read_text())["model_save_format"] == "adapter"
    listing = run_command([CKPT_TRAIN, "inspect", str(run), "--json"], env=env_for(assets), timeout=300)
    assert [r["format"] for r in json.loads(listing.stdout)["checkpoints"]] == ["adapter", "adapter"]


def test_adapter_holds_exactly_the_lora_tensors(work, assets):
    weights = _model_dir(_straight(work, assets)) / layout.ADAPTER_WEIGHTS
    rank = json.loads((weights.parent / layout.ADAPTER_CONFIG).read_text())["r"]
    with safe_open(str(weights), "pt") as f:
        keys = set(f.keys())
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in keys}
    assert keys == _expected_adapter_keys(assets)  # PEFT names, no ".default", nothing else
    assert all((".lora_A." in k and s[0] == rank) or (".lora_B." in k and s[1] == rank) for k, s in shapes.items())
    payload = sum(4 * s[0] * s[1] for s in shapes.values())  # float32
    assert payload < weights.stat().st_size < payload + 64 * 1024  # tensors plus a header, nothing more
    base_bytes = sum(p.stat().st_size for p in (assets / "tiny_llama_base").glob("*.safetensors"))
    assert weights.stat().st_size < base_bytes


# --------------------------------------------------------------------------------- Hugging Face use


@cache
def _validation_batches(run: Path) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The run's validation set, rebuilt from its config.yaml exactly as the recipe built it."""
    from automodel_ckpt.config.loader import load_config
    from automodel_ckpt.config.schema import RecipeConfig
    from automodel_ckpt.data import prepare_data
    from automodel_ckpt.models.build import build_tokenizer

    cfg = load_config(run / "epoch_0_step_8" / "config.yaml", [], RecipeConfig)
    val = prepare_data(cfg, build_tokenizer(str(_model_dir(run)))).validation
    return [(val.input_ids, val.attention_mask, val.labels)]


def _val_loss(model, batches) -> float:
    from automodel_ckpt.data.tokenize import IGNORE_INDEX

    total, tokens = 0.0, 0
    with torch.no_grad():
        for input_ids, mask, labels in batches:
            logits = model(input_ids=input_ids, attention_mask=mask).logits.float()
            total += torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                                       ignore_index=IGNORE_INDEX, reduction="sum").item()
            tokens += int((labels[:, 1:] != IGNORE_INDEX).sum())
    return total / tokens


def test_peft_loads_the_checkpoint_offline_and_matches_the_trained_model(work, assets):
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = _straight(work, assets)
    model_dir = _model_dir(run)
    model = AutoPeftModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    assert tokenizer("12+34=").input_ids[1:] == tokenizer.convert_tokens_to_ids(list("12+34="))

    # 1. The loaded model is the trained one: its validation loss is the one the run logged at step 8.
    batches = _validation_batches(run)
    logged = next(r["val_loss"] for r in jsonl(run / "validation.jsonl") if r["step"] == 8)
    assert _val_loss(model, batches) == pytest.approx(logged, rel=1e-5, abs=1e-6)
    with model.disable_adapter():
        assert abs(_val_loss(model, batches) - logged) > 1e-3  # the adapter matters: the check above can fail

    # 2. Same logits as the base plus W + (alpha / r) * B @ A applied by hand from the files.
    config = json.loads((model_dir / layout.ADAPTER_CONFIG).read_text())
    scale = config["lora_alpha"] / config["r"]
    manual = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"], dtype=torch.float32).eval()
    params = dict(manual.named_parameters())
    with safe_open(str(model_dir / layout.ADAPTER_WEIGHTS), "pt") as f, torch.no_grad():
        for key in f.keys():
            if ".lora_A." in key:
                module = key.removeprefix("base_model.model.").split(".lora_A.")[0]
                a, b = f.get_tensor(key), f.get_tensor(key.replace(".lora_A.", ".lora_B."))
                params[f"{module}.weight"] += scale * (b @ a)
    input_ids, mask, _ = batches[0]
    with torch.no_grad():
        ours = model(input_ids=input_ids[:16], attention_mask=mask[:16]).logits
        theirs = manual(input_ids=input_ids[:16], attention_mask=mask[:16]).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_example_script_generates_from_the_adapter_folder(work, assets, capsys):
    model_dir = _model_dir(_straight(work, assets))
    # examples/peft_generate.py through its main(argv), in this process: what its command line runs, without a new
    # interpreter importing torch, transformers and peft again
    if str(REPO / "examples") not in sys.path:
        sys.path.insert(0, str(REPO / "examples"))  # the script's own folder, as when it runs (examples/evaluation.py)
    import peft_generate

    capsys.readouterr()
    code = peft_generate.main([str(model_dir), "--n", "20"])
    out = capsys.readouterr().out
    assert code == 0, out[-3000:]
    assert "accuracy: " in out and "(" in out.split("accuracy: ")[1]


def _greedy(model, tokenizer, prompts: list[str], new_tokens: int = 6) -> tuple[list[list[int]], list[float]]:
    """Greedy continuations of a fixed length (not cut at end-of-sequence, so every decision counts), and for each
    prompt the smallest gap between the chosen and the runner-up logit along the way."""
    batch = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=tokenizer.pad_token_id, output_scores=True, return_dict_in_generate=True)
    top2 = torch.stack([scores.float().topk(2, dim=-1).values for scores in out.scores], dim=1)
    margins = (top2[..., 0] - top2[..., 1]).min(dim=1).values
    return out.sequences[:, batch["input_ids"].shape[1]:].tolist(), margins.tolist()


def _last_logits(model, tokenizer, prompts: list[str]) -> torch.Tensor:
    batch = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    with torch.no_grad():
        return model(**batch).logits[:, -1].float()


def test_merge_lora_writes_a_full_model_that_generates_like_the_adapter(work, assets):
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from automodel_ckpt.data.builtin import heldout_examples

    checkpoint = _straight(work, assets) / "epoch_0_step_8"
    result = run_command([CKPT_TRAIN, "merge-lora", str(checkpoint)], env=env_for(assets), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    merged_dir = checkpoint / layout.MODEL_DIR / layout.MERGED_DIR
    assert f"Merged model written to {merged_dir}" in result.stdout
    assert json.loads((merged_dir / layout.HF_CONFIG).read_text())["dtype"] == "bfloat16"
    assert {"tokenizer.json", "tokenizer_config.json", layout.HF_CONFIG} <= {p.name for p in merged_dir.iterdir()}
    assert not list(merged_dir.parent.glob(".merged.*"))  # the temporary folder was renamed into place

    for weights in merged_dir.glob("*.safetensors"):
        with safe_open(str(weights), "pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}  # the base's per-tensor dtype

    # Both computed in float32, so they differ only by the bf16 rounding of the merged weights.
    merged = AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=torch.float32).eval()
    adapter = AutoPeftModelForCausalLM.from_pretrained(str(checkpoint / layout.MODEL_DIR), dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(str(assets / "tiny_llama_base"), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(merged_dir))
    prompts = [p for p, _ in heldout_examples(14)] + ["12+34=", "7+8="]
    merged_logits = _last_logits(merged, tokenizer, prompts)
    rounding = (merged_logits - _last_logits(adapter, tokenizer, prompts)).abs().max().item()
    assert rounding < 0.1 * (merged_logits - _last_logits(base, tokenizer, prompts)).abs().max().item()
    # Greedy text is equal wherever the adapter model's choices are not near-ties at the rounding scale.
    merged_tokens, _ = _greedy(merged, tokenizer, prompts)
    adapter_tokens, margins = _greedy(adapter, tokenizer, prompts)
    decided = [i for i, margin in enumerate(margins) if margin > 10 * rounding]
    assert len(decided) >= len(prompts) // 4, (margins, rounding)
    assert [merged_tokens[i] for i in decided] == [adapter_tokens[i] for i in decided]
    assert merged_tokens != _greedy(base, tokenizer, prompts)[0]  # the merge changed the model
    verify = run_command([CKPT_TRAIN, "verify", str(checkpoint)], env=env_for(assets), timeout=300)
    assert verify.returncode == 0, verify.stdout + verify.stderr  # the manifest lists the merged files
    # ckpt-train diff of the merged model against its base: only LoRA's target modules differ
    from automodel_ckpt.evaluation.diff import diff

    report = diff(assets / "tiny_llama_base", merged_dir)
    changed = {n for n, d in report.tensors.items() if d.status != "equal"}
    targets = json.loads((checkpoint / layout.MODEL_DIR / layout.ADAPTER_CONFIG).read_text())["target_modules"]
    targeted = {n for n in report.tensors if n.split(".")[-2] in targets}  # the module a weight belongs to
    assert changed and changed <= targeted, sorted(changed - targeted)[:5]
    assert any(n.startswith("model.embed_tokens") for n in report.tensors) and report.groups()["embeddings"] == \
        {"equal": 1}  # what LoRA does not target is the base's bit for bit


# ------------------------------------------------------------------------------------------ resume


def test_resume_is_bitwise_exact_and_torch_save_falls_back_to_the_adapter(work, assets):
    straight = _straight(work, assets)
    resumed, first, second = _resumed_torch_save(work, assets)
    assert first.count(FALLBACK_WARNING) == 1, first[-3000:]
    assert f"Loading checkpoint from {resumed.name}/epoch_0_step_4" in second
    assert len(losses(straight)) == 8
    assert losses(resumed) == losses(straight)  # bitwise: same floats
    assert [r["val_loss"] for r in jsonl(resumed / "validation.jsonl")] == \
           [r["val_loss"] for r in jsonl(straight / "validation.jsonl")]
    for step in (4, 8):
        model_files = {p.name for p in _model_dir(resumed, step).iterdir()}
        assert ADAPTER_FILES <= model_files and not any(n.endswith(".distcp") for n in model_files)


def test_restore_from_another_runs_checkpoint_is_exact(work, assets):
    straight = _straight(work, assets)
    restored, output = _restored(work, assets)
    assert f"Loading checkpoint from {straight / 'epoch_0_step_4'}" in output
    records = jsonl(restored / "training.jsonl")
    assert [r["step"] for r in records] == [5, 6, 7, 8]
    assert [r["loss"] for r in records] == losses(straight)[4:]
    assert os.readlink(restored / "LATEST") == "epoch_0_step_8"


def test_load_only_model_from_an_adapter_folder_starts_a_new_run_with_its_weights(work, assets):
    from safetensors.torch import load_file

    source = _model_dir(_straight(work, assets))  # a PEFT adapter folder
    result = _train(work, assets, "from_adapter", 2, "--checkpoint.restore_from", str(source),
                    "--checkpoint.load_only", "[model]", "--optimizer.lr", "0")
    assert f"Started from model of {source}" in result.output
    saved = load_file(source / layout.ADAPTER_WEIGHTS)
    now = load_file(_model_dir(work / "from_adapter", 2) / layout.ADAPTER_WEIGHTS)  # lr 0: unchanged
    assert saved.keys() == now.keys() and all(torch.equal(saved[k], now[k]) for k in saved)
    assert [r["step"] for r in jsonl(work / "from_adapter" / layout.TRAINING_LOG)] == [1, 2]


# ----------------------------------------------------------------------------------- pipeline stages


def test_lora_under_pipeline_stages_trains_saves_and_resumes_as_without_them(work, assets):
    """pp 2 on 2 processes: every step's loss and gradient norm those of the straight dp 2 run, and an adapter folder
    with the same tensors that PEFT loads to the straight run's logits; resumed on pp 2 from the straight run's
    step-4 checkpoint, step 5 as the straight run's."""
    from peft import AutoPeftModelForCausalLM

    straight = _straight(work, assets)
    pp = ("--distributed.pp_size", "2")
    _train(work, assets, "pp", 4, *pp)
    out = _train(work, assets, "pp_resumed", 5, *pp, "--checkpoint.restore_from", str(straight / "epoch_0_step_4"))
    assert "Resuming a dp 2 checkpoint on pp 2" in out.stdout
    want = {r["step"]: r for r in jsonl(straight / "training.jsonl")}
    got = jsonl(work / "pp" / "training.jsonl") + jsonl(work / "pp_resumed" / "training.jsonl")
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5]
    for record in got:
        assert record["loss"] == pytest.approx(want[record["step"]]["loss"], abs=1e-5), record["step"]
        assert record["grad_norm"] == pytest.approx(want[record["step"]]["grad_norm"], rel=1e-5), record["step"]
    with safe_open(str(_model_dir(work / "pp", 4) / layout.ADAPTER_WEIGHTS), "pt") as f:
        assert set(f.keys()) == _expected_adapter_keys(assets)  # every stage's adapters, once
    input_ids, mask, _ = _validation_batches(straight)[0]
    logits = []
    for run in (straight, work / "pp"):
        model = AutoPeftModelForCausalLM.from_pretrained(str(_model_dir(run, 4)), dtype=torch.float32).eval()
        with torch.no_grad():
            logits.append(model(input_ids=input_ids[:16], attention_mask=mask[:16]).logits)
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=1e-5)
