"""Resume that heals itself and knows its run, end to end on 2 processes.

Shared runs: 8 steps straight (the reference losses) and 6 steps with a checkpoint every 2 (the run to damage, to
rerun with another model, and to start new runs from). Each test copies the 6-step folder before changing it.
"""

from __future__ import annotations

import json
import os
import shutil
from functools import cache
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from automodel_ckpt.ondisk import CheckpointFolder, layout
from tests.integration.harness import CKPT_TRAIN, RECIPE, ckpt_train, env_for, losses, run_command, tree

COMMON = ("--step_scheduler.ckpt_every_steps", "2", "--step_scheduler.val_every_steps", "2", "--data.val_size", "64")
STEP6 = "epoch_0_step_6"


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("heal")


@cache
def _run(work: Path, assets: Path, name: str, steps: int) -> Path:
    ckpt_train(work, assets, *COMMON, "--checkpoint.checkpoint_dir", name, "--step_scheduler.max_steps", str(steps),
               nproc=2)
    return work / name


def _copy(work: Path, assets: Path, name: str) -> Path:
    target = work / name
    shutil.copytree(_run(work, assets, "six", 6), target, symlinks=True)
    return target


def _model_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def _optimizer_steps(checkpoint: Path, scratch: Path) -> set[float]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint / layout.OPTIM_DIR, scratch)
    state = torch.load(scratch, weights_only=False)
    found: set[float] = set()

    def walk(value, key=""):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, str(k))
        elif key == "step":
            found.add(float(value))

    walk(state)
    return found


def _damage(folder: Path, how: str) -> None:
    model = folder / layout.MODEL_DIR
    shard = max((f for f in model.glob("*.safetensors")), key=lambda f: f.stat().st_size)
    if how == "flip":  # a byte of tensor data: only checksums see it
        data = bytearray(shard.read_bytes())
        data[-100] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif how == "truncate":
        optim = folder / layout.OPTIM_DIR / layout.dcp_rank_file(1)
        optim.write_bytes(optim.read_bytes()[: optim.stat().st_size // 2])
    else:
        shard.unlink()


@pytest.mark.parametrize("how", ["flip", "truncate", "delete"])
def test_damaged_newest_checkpoint_is_quarantined_and_the_run_resumes_from_the_previous(
        work: Path, assets: Path, how: str) -> None:
    run = _copy(work, assets, f"damaged-{how}")
    _damage(run / STEP6, how)
    extra = ("--checkpoint.verify_on_load", "true") if how == "flip" else ()
    result = ckpt_train(work, assets, *COMMON, "--checkpoint.checkpoint_dir", run.name,
                        "--step_scheduler.max_steps", "8", *extra, nproc=2)
    assert f"checkpoint '{STEP6}' cannot be loaded" in result.output
    assert "Loading checkpoint from" in result.output and "epoch_0_step_4" in result.output
    assert losses(run) == losses(_run(work, assets, "straight", 8))  # bitwise: resumed from step 4, redid 5-8
    assert (run / layout.QUARANTINE_DIR / STEP6).is_dir()
    assert json.loads((run / layout.QUARANTINE_DIR / layout.quarantine_note(STEP6)).read_text())["step"] == 6
    assert Path(os.readlink(run / layout.LATEST)).name == "epoch_0_step_8"
    listing = run_command([CKPT_TRAIN, "inspect", str(run), "--json"], env=env_for(assets), timeout=300)
    assert listing.returncode == 0, listing.stderr[-2000:]
    report = json.loads(listing.stdout)
    assert [q["name"] for q in report["quarantined"]] == [STEP6]
    assert STEP6 in [r["name"] for r in report["checkpoints"]]  # step 6 written again by the resumed run


def test_named_restore_from_that_fails_is_an_error_never_a_fallback(work: Path, assets: Path) -> None:
    run = _copy(work, assets, "named")
    _damage(run / STEP6, "delete")
    before = tree(run)
    result = ckpt_train(work, assets, *COMMON, "--checkpoint.checkpoint_dir", run.name, "--step_scheduler.max_steps",
                        "8", "--checkpoint.restore_from", STEP6, nproc=2, check=False)
    assert result.returncode == 3  # CheckpointError's, from the launcher as from the worker
    assert "is damaged" in result.output and "Traceback" not in result.output
    # one error, one line: torch's agent adds no "failed (exitcode: 3)" line (nor its error-file banner) between
    # the worker's error and the launcher's summary
    assert "failed (exitcode" not in result.output and "error_file" not in result.output, result.output[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert errors[-1] == "error: training failed on rank 0 (exit code 3); see its message above", errors
    assert all(line.startswith(("error:", "[rank ")) for line in errors), errors
    assert len(errors) == 2 and "is damaged" in errors[0], errors  # both ranks refuse it: said once, by rank 0
    assert tree(run) == before


def test_on_load_error_error_stops(work: Path, assets: Path) -> None:
    run = _copy(work, assets, "strict")
    _damage(run / STEP6, "truncate")
    result = ckpt_train(work, assets, *COMMON, "--checkpoint.checkpoint_dir", run.name, "--step_scheduler.max_steps",
                        "8", "--checkpoint.on_load_error", "error", nproc=2, check=False)
    assert result.returncode != 0 and "is damaged" in result.output
    assert not (run / layout.QUARANTINE_DIR).exists()


def _other_model_recipe(work: Path, assets: Path) -> Path:
    base = json.loads((assets / "tiny_llama_base" / "config.json").read_text())
    recipe = yaml.safe_load(RECIPE.read_text())
    keys = ("vocab_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")
    recipe["model"]["config"] = {"model_type": "llama", **{k: base[k] for k in keys if k in base},
                                 "hidden_size": base["hidden_size"] * 2}
    recipe["model"]["pretrained_model_name_or_path"] = recipe["model"]["embedded"] = None  # built from the config
    recipe["tokenizer"] = {"pretrained_model_name_or_path": str(assets / "tiny_llama_base")}
    path = work / "other_model.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _other_tokenizer(work: Path, assets: Path) -> Path:
    folder = work / "other_tokenizer"
    if not folder.exists():
        shutil.copytree(assets / "tiny_llama_base", folder)
        spec = json.loads((folder / "tokenizer.json").read_text())
        vocab = spec["model"]["vocab"]
        token = next(t for t in vocab if t not in ("<unk>", "<s>", "</s>", "<pad>") and len(t) == 1)
        vocab["Z" if token != "Z" else "Y"] = vocab.pop(token)
        (folder / "tokenizer.json").write_text(json.dumps(spec))
    return folder


@pytest.mark.parametrize("change", ["hidden_size", "tokenizer"])
def test_rerun_with_another_model_stops_before_training(work: Path, assets: Path, change: str) -> None:
    run = _copy(work, assets, f"other-{change}")
    before = {p: (run / p).stat().st_size for p in tree(run) if (run / p).is_file()}
    if change == "hidden_size":
        args, recipe = (), _other_model_recipe(work, assets)
    else:
        args, recipe = ("--tokenizer.pretrained_model_name_or_path", str(_other_tokenizer(work, assets))), RECIPE
    result = ckpt_train(work, assets, *COMMON, "--checkpoint.checkpoint_dir", run.name, "--step_scheduler.max_steps",
                        "8", *args, nproc=2, recipe=recipe, check=False)
    assert result.returncode != 0
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert errors and "is a checkpoint of another run" in errors[0], result.output[-2000:]
    assert "'hidden_size' is 128 there, 256 here" in errors[0] if change == "hidden_size" else \
        "tokenizer's vocabulary differs" in errors[0]
    assert "Traceback" not in result.output
    assert {p: (run / p).stat().st_size for p in tree(run) if (run / p).is_file()} == before  # nothing written


def test_rerun_with_one_process_resumes(work: Path, assets: Path) -> None:
    run = _copy(work, assets, "one-process")
    result = ckpt_train(work, assets, *COMMON, "--checkpoint.checkpoint_dir", run.name, "--step_scheduler.max_steps",
                        "8", nproc=1)
    assert f"Loading checkpoint from {run.name}/{STEP6}" in result.output or STEP6 in result.output
    assert (run / "epoch_0_step_8").is_dir()


@pytest.mark.parametrize("source", ["checkpoint", "consolidated"])
def test_load_only_model_starts_a_new_run_from_the_weights(work: Path, assets: Path, source: str) -> None:
    six = _run(work, assets, "six", 6)
    origin = six / STEP6 if source == "checkpoint" else CheckpointFolder(six / STEP6).model.consolidated.path
    name = f"from-{source}"
    ckpt_train(work, assets, *COMMON, "--checkpoint.checkpoint_dir", name, "--step_scheduler.max_steps", "2",
               "--checkpoint.restore_from", str(origin), "--checkpoint.load_only", "[model]", "--optimizer.lr", "0",
               nproc=2)
    new = work / name / "epoch_0_step_2"
    assert json.loads((new / layout.METADATA_FILE).read_text())["step"] == 2
    assert _optimizer_steps(new, work / f"{name}-optim.pt") == {2.0}  # a fresh optimizer: this run's 2 steps
    if source == "checkpoint":  # lr 0: the weights are still exactly the step-6 weights
        saved = _model_tensors(six / STEP6 / layout.MODEL_DIR)
        now = _model_tensors(new / layout.MODEL_DIR)
    else:  # the export (base dtypes) of the new run equals the folder it started from
        saved = _model_tensors(origin)
        now = _model_tensors(CheckpointFolder(new).model.consolidated.path)
    assert saved.keys() == now.keys()
    assert all(torch.equal(saved[k], now[k]) for k in saved)
    log = [json.loads(line) for line in (work / name / layout.TRAINING_LOG).read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2]
