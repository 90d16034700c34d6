"""HF export end to end: save_consolidated modes, consolidate.sh from anywhere, dtypes, multi-process identity."""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import torch

from tests.integration.harness import CKPT_TRAIN, ckpt_train, env_for, run_command

STEPS = ("--step_scheduler.max_steps", "4", "--step_scheduler.ckpt_every_steps", "2", "--data.val_size", "64")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("export")


@cache
def _run(work: Path, assets: Path, mode: str, fmt: str = "safetensors") -> tuple[Path, str]:
    name = f"{mode}_{fmt}"
    result = ckpt_train(work, assets, *STEPS, "--checkpoint.save_consolidated", mode,
                        "--checkpoint.model_save_format", fmt, "--checkpoint.checkpoint_dir", name, nproc=2)
    return work / name, result.output


def _has_export(run: Path, step: int) -> bool:
    return (run / f"epoch_0_step_{step}" / "model" / "consolidated" / "model.safetensors.index.json").exists()


def test_final_exports_only_the_last_checkpoint(work, assets):
    run, _ = _run(work, assets, "final")
    assert not _has_export(run, 2) and _has_export(run, 4)


def test_every_exports_each_checkpoint(work, assets):
    run, _ = _run(work, assets, "every")
    assert _has_export(run, 2) and _has_export(run, 4)


def _consolidate_sh(model_dir: Path, cwd: Path, assets: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(model_dir / "consolidate.sh")], cwd=cwd, capture_output=True, text=True,
                          timeout=600, env=env_for(assets, {"PYTHON": sys.executable, **env}))


def test_false_exports_nothing_until_consolidate_sh_runs_from_anywhere(work, assets, tmp_path):
    run, _ = _run(work, assets, "false")
    assert not _has_export(run, 2) and not _has_export(run, 4)
    model_dir = run / "epoch_0_step_2" / "model"
    elsewhere = tmp_path / "somewhere" / "else"
    elsewhere.mkdir(parents=True)
    done = _consolidate_sh(model_dir, elsewhere, assets)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _has_export(run, 2)
    assert not list(elsewhere.iterdir())  # nothing written where it was run from
    again = _consolidate_sh(model_dir, elsewhere, assets)  # running twice is safe
    assert again.returncode == 0, again.stderr[-3000:]
    verified = run_command([CKPT_TRAIN, "verify", str(run / "epoch_0_step_2")], env=env_for(assets), timeout=300)
    assert verified.returncode == 0, verified.stdout[-3000:]  # the export joined the checkpoint's manifest


def _full_state(model_dir: Path) -> dict[str, torch.Tensor]:
    """The trained weights, reassembled from the per-rank shards with torch's own reader."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    reader = HuggingFaceStorageReader(str(model_dir))
    meta = reader.read_metadata()
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.state_dict_metadata.items()}
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def test_export_restores_base_dtypes_and_loads_in_transformers(work, assets):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    run, _ = _run(work, assets, "final")
    model_dir = run / "epoch_0_step_4" / "model"
    out = model_dir / "consolidated"
    trained = _full_state(model_dir)
    exported = {}
    for f in sorted(out.glob("model-*.safetensors")):
        exported.update(load_file(f))
    assert set(exported) == set(trained)
    for name, tensor in exported.items():
        assert tensor.dtype == torch.bfloat16  # the embedded base is bf16; training ran in fp32
        assert torch.equal(tensor, trained[name].to(torch.bfloat16)), name
    base_index = json.loads((assets / "tiny_llama_base" / "model.safetensors.index.json").read_text())
    ours = json.loads((out / "model.safetensors.index.json").read_text())
    assert {k: v.split("-")[1] for k, v in ours["weight_map"].items()} == \
           {k: v.split("-")[1] for k, v in base_index["weight_map"].items()}  # same file number per tensor
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    pipe = pipeline("text-generation", model=model, tokenizer=tok)
    assert pipe("12+34=", max_new_tokens=4, do_sample=False)[0]["generated_text"].startswith("12+34=")


def test_cast_fp32_export_generates_exactly_like_the_trained_weights(work, assets, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run, _ = _run(work, assets, "final")
    model_dir = run / "epoch_0_step_2" / "model"
    done = _consolidate_sh(model_dir, tmp_path, assets, CAST_DTYPE="fp32")
    assert done.returncode == 0, done.stderr[-3000:]
    out = model_dir / "consolidated"
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    exported = AutoModelForCausalLM.from_pretrained(out)
    assert all(p.dtype == torch.float32 for p in exported.parameters())
    reference = AutoModelForCausalLM.from_pretrained(out)
    reference.load_state_dict(_full_state(model_dir))  # the training weights, straight from the shards
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok(["12+34=", "7+58=", "99+1="], return_tensors="pt", padding=True)
    with torch.no_grad():
        assert torch.equal(exported(**ids).logits, reference(**ids).logits)
    gen_a = exported.generate(**ids, max_new_tokens=4, do_sample=False)
    gen_b = reference.generate(**ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(gen_a, gen_b)


def test_two_workers_write_byte_identical_files(work, assets, tmp_path):
    run, _ = _run(work, assets, "every")
    model_dir = run / "epoch_0_step_2" / "model"
    single = tmp_path / "single"
    os.rename(model_dir / "consolidated", single)
    done = _consolidate_sh(model_dir, tmp_path, assets, NPROC_PER_NODE="2", NUM_THREADS="2")
    assert done.returncode == 0, done.stderr[-3000:]
    multi = model_dir / "consolidated"
    names = sorted(p.name for p in single.iterdir())
    assert names == sorted(p.name for p in multi.iterdir())
    match, mismatch, errors = filecmp.cmpfiles(single, multi, names, shallow=False)
    assert mismatch == [] and errors == []


def test_torch_save_checkpoint_exports_to_the_same_folder(work, assets):
    run, output = _run(work, assets, "final", "torch_save")
    assert "needs model_save_format=safetensors" in output  # warned, inline export skipped
    ckpt = run / "epoch_0_step_4"
    assert not (ckpt / "model" / "consolidated").exists()
    done = run_command([CKPT_TRAIN, "consolidate", str(ckpt)], env=env_for(assets), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    reference = _run(work, assets, "final")[0] / "epoch_0_step_4" / "model" / "consolidated"
    exported = ckpt / "model" / "consolidated"
    names = sorted(p.name for p in reference.iterdir())
    assert sorted(p.name for p in exported.iterdir()) == names
    _, mismatch, errors = filecmp.cmpfiles(reference, exported, names, shallow=False)
    assert mismatch == [] and errors == []  # same training, other format: the very same HF folder
