"""Real model families end to end, 2 processes: export in the base's layout, exact resume, default LoRA.

The unit matrix (tests/unit/export/test_export_families.py, test_lora_families.py) covers all seven families in both
source formats without processes; these runs cover a representative subset through `ckpt-train` itself, within
the CI budget: Conv1D with tied embeddings (gpt2) and both mixture-of-experts layouts (mixtral, qwen3_moe), in
both model save formats, the mixtral run with ``lr: 0`` (its export must be the base's files, bit for bit), plus
default LoRA on a mixture of experts without a PEFT default (qwen3_moe).
"""

from __future__ import annotations

import filecmp
import json
import subprocess
from functools import cache
from pathlib import Path

import pytest
import torch

from automodel_ckpt.models.materialize import RECORD_ENV
from tests.family_bases import folder_weights, row_shares

from tests.integration.harness import CKPT_TRAIN, REPO, ckpt_train, env_for, jsonl, run_command

PEFT_RECIPE = REPO / "recipes" / "tiny_llama_peft.yaml"
SMALL = ("--dataset.num_samples", "400", "--data.val_size", "16", "--step_scheduler.val_every_steps", "null",
         "--step_scheduler.global_batch_size", "8", "--step_scheduler.local_batch_size", "4",
         "--step_scheduler.ckpt_every_steps", "1")  # fmt: skip
#: (family, model_save_format, optimizer.lr): lr 0 leaves the weights as they are in the base.
FULL = [("gpt2", "torch_save", "3e-3"), ("mixtral", "safetensors", "0"), ("qwen3_moe", "torch_save", "3e-3")]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("families")


def _model(base: Path) -> tuple[str, ...]:
    return ("--model.pretrained_model_name_or_path", str(base), "--model.embedded", "null")


@cache
def _run(work: Path, assets: Path, base: Path, name: str, *args: str, recipe: Path | None = None):
    extra = {"recipe": recipe} if recipe is not None else {}
    result = ckpt_train(work, assets, *_model(base), *SMALL, "--checkpoint.checkpoint_dir", name, *args, nproc=2,
                        env={RECORD_ENV: str(work / f"{name}.record")}, **extra)
    return work / name, result.output


def _cli(assets: Path, *args: str) -> subprocess.CompletedProcess:
    return run_command([CKPT_TRAIN, *args], timeout=600, env=env_for(assets))


def _export(assets: Path, ckpt: Path) -> Path:
    out = ckpt / "model" / "consolidated"
    if not out.is_dir():
        done = _cli(assets, "consolidate", str(ckpt))
        assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.mark.parametrize("family, fmt, lr", FULL)
def test_trains_resumes_exactly_and_exports_in_the_base_layout(work, assets, family_bases, family, fmt, lr):
    base = family_bases[family]
    # sharded (a model this small would be replicated): each rank reads only its slices of the base
    fmt_arg = ("--checkpoint.model_save_format", fmt, "--step_scheduler.max_steps", "3", "--optimizer.lr", lr,
               "--distributed.dp_shard", "full")
    straight, _ = _run(work, assets, base, f"{family}_{fmt}", *fmt_arg)
    resumed, out = _run(work, assets, base, f"{family}_{fmt}_resumed", *fmt_arg,
                        "--checkpoint.restore_from", str(straight / "epoch_0_step_1"))
    assert "epoch_0_step_1" in out
    a, b = jsonl(straight / "training.jsonl"), jsonl(resumed / "training.jsonl")
    def steps(records: list[dict]) -> list[tuple]:
        return [(r["step"], r["loss"], r["grad_norm"]) for r in records]

    assert steps(a[1:]) == steps(b)
    first, second = _export(assets, straight / "epoch_0_step_3"), _export(assets, resumed / "epoch_0_step_3")
    files = sorted(p.name for p in first.glob("*.safetensors"))
    assert files and filecmp.cmpfiles(first, second, files, shallow=False)[0] == files  # bitwise same weights

    done = _cli(assets, "verify", "--export", str(straight / "epoch_0_step_3"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"({family}, " in done.stdout and "no missing or unexpected keys" in done.stdout
    listing = _cli(assets, "inspect", str(straight))
    assert listing.returncode == 0 and f" {family} " in listing.stdout
    records = [json.loads((work / f"{family}_{fmt}.record" / f"rank{r}.json").read_text()) for r in range(2)]
    data_bytes, share = row_shares(base, 2)
    read = [r["base_bytes_read"] for r in records]  # fused experts too: each rank its own experts' parts
    assert all(0 < n <= share for n in read) and sum(read) == data_bytes, (read, share, data_bytes)
    if float(lr) == 0:  # the lr=0 oracle: the base's files, bit for bit (every family: the unit matrix)
        _assert_base_files(base, first)


def _assert_base_files(base: Path, export: Path) -> None:
    expected, actual = folder_weights(base), folder_weights(export)
    assert sorted(actual) == sorted(expected)
    for name, (file, tensor) in expected.items():
        assert actual[name][0] == file and actual[name][1].dtype == tensor.dtype, name
        assert torch.equal(actual[name][1].view(torch.uint8), tensor.view(torch.uint8)), name


def test_default_lora_trains_loads_in_peft_and_merges(work, assets, family_bases, tmp_path):
    from peft import AutoPeftModelForCausalLM

    family, adapted = "qwen3_moe", "k_proj, o_proj, q_proj, v_proj"  # attention only: a mixture of experts
    base = family_bases[family]
    run, out = _run(work, assets, base, f"{family}_lora", "--peft.target_modules", "null",
                    "--step_scheduler.max_steps", "2", recipe=PEFT_RECIPE)
    assert f"LoRA: {family}, " in out and f"({adapted} in every layer" in out
    losses = [r["loss"] for r in jsonl(run / "training.jsonl")]
    assert len(losses) == 2 and all(loss == loss for loss in losses)
    adapter = run / "epoch_0_step_2" / "model"
    model = AutoPeftModelForCausalLM.from_pretrained(str(adapter))
    assert any("lora_A" in n for n, _ in model.named_parameters())
    done = _cli(assets, "merge-lora", str(run / "epoch_0_step_2"), "--out", str(tmp_path / "merged"))
    assert done.returncode == 0, done.stderr[-3000:]
    merged, base_files = folder_weights(tmp_path / "merged"), folder_weights(base)
    def layout_of(weights: dict) -> dict:
        return {k: (t.shape, t.dtype) for k, (_, t) in weights.items()}

    assert layout_of(merged) == layout_of(base_files)
