"""Runs cross trainers: an HF Trainer or Lightning checkpoint imported and continued here (1 and 2 processes), ours
exported and continued by the HF Trainer, a LoRA run, and hostile sources refused in one line before anything runs."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.integration import foreign_trainers as ft
from tests.integration import harness, warm_launch
from tests.integration.harness import CKPT_TRAIN, ckpt_train, env_for, jsonl, run_command


def _import(tmp: Path, assets: Path, src: Path, recipe: Path, out: str = "run", *extra: str):
    return run_command([CKPT_TRAIN, "import", str(src), str(recipe), "--out", out, *extra], cwd=tmp,
                       env=env_for(assets), timeout=600)


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in jsonl(run_dir / "training.jsonl")}


def _assert_close(got: dict[int, float], want: dict[int, float], steps=range(ft.SAVED_AT + 1, ft.STEPS + 1)):
    print("largest difference:", max(abs(got[step] - want[step]) for step in steps))  # shown with -s
    for step in steps:
        assert got[step] == pytest.approx(want[step], abs=1e-5), (step, got, want)


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory, assets):
    """The HF Trainer's checkpoint-6 of the linear-warmup recipe (2 micro-batches of 4 rows a step, weight decay
    but for biases and norms) and its own continuation's losses (steps 7-10)."""
    folder = tmp_path_factory.mktemp("hf_trainer")
    recipe = ft.write_recipe(folder, assets, ft.HF_LINEAR, decay=True)
    rows = ft.recipe_rows(recipe)
    trainer = {"accumulation": 2, "weight_decay": ft.DECAY}
    ft.LossTrainer(folder / "out", rows, assets, **trainer).train()
    continued = ft.LossTrainer(folder / "again", rows, assets, **trainer).train(resume=folder / "out" / "checkpoint-6")
    return folder / "out" / "checkpoint-6", recipe, continued, rows


PLAIN = "{_target_: automodel_ckpt.training.lr.constant_after_warmup, warmup_steps: 0}"


def _plain_recipe(folder: Path, assets: Path, max_steps: int = 40) -> Path:
    """A recipe that knows nothing of the source: another schedule, one AdamW group without decay, and (where the
    source's schedule has an end: the HF Trainer's) another length."""
    folder.mkdir(exist_ok=True)
    recipe = ft.write_recipe(folder, assets, PLAIN)
    recipe.write_text(recipe.read_text().replace("max_steps: 10", f"max_steps: {max_steps}"))
    return recipe


def _continued_with_the_printed_command(done, run: str = "run") -> Path:
    """The command the import printed: ``ckpt-train RUN/recipe.yaml``, nothing else."""
    assert done.returncode == 0, done.stderr[-3000:]
    command = done.stdout.strip().splitlines()[-1].split("continue with: ")[1]
    assert command == f"ckpt-train {run}/recipe.yaml", done.stdout
    return Path(command.split()[1])


def test_an_hf_trainer_run_continues_here_on_one_and_two_processes(tmp_path, assets, hf_run):
    """Imported into a recipe without the Trainer's schedule, length or weight decay: the run folder's recipe.yaml
    has them, and the printed command continues the run."""
    checkpoint, _, continued, _ = hf_run
    done = _import(tmp_path, assets, checkpoint, _plain_recipe(tmp_path / "plain", assets))
    written = _continued_with_the_printed_command(done)
    assert "Imported HF Trainer checkpoint (step 6) as run/epoch_0_step_6" in done.stdout
    text = (tmp_path / written).read_text()
    assert text.startswith("# Written by ckpt-train import: HF Trainer checkpoint (step 6) from ")
    assert "optimizer._target_ = automodel_ckpt.training.decay.AdamWNoDecay" in done.stdout
    assert f"optimizer.weight_decay = {ft.DECAY}" in done.stdout and "step_scheduler.max_steps = 10" in done.stdout
    assert "lr_scheduler = {'_target_': 'automodel_ckpt.training.lr.linear_decay'" in done.stdout
    meta = json.loads((tmp_path / "run" / "epoch_0_step_6" / "metadata.json").read_text())
    imported = meta["lineage"]["parents"][-1]  # the import's lineage: the Trainer's checkpoint, by fingerprint
    assert imported["role"] == "imported from" and imported["path"] == str(checkpoint.absolute())
    assert imported["trainer"] == "HF Trainer checkpoint (step 6)" and imported["fingerprint"].startswith("sha256:")
    shutil.copytree(tmp_path / "run", tmp_path / "run2")
    (tmp_path / "run2" / "recipe.yaml").write_text(text.replace("checkpoint_dir: run\n", "checkpoint_dir: run2\n"))
    for nproc, run in ((1, "run"), (2, "run2")):
        args = () if nproc == 1 else ("--step_scheduler.local_batch_size", str(ft.BATCH // nproc))
        ckpt_train(tmp_path, assets, *args, recipe=tmp_path / run / "recipe.yaml", nproc=nproc)
        records = {r["step"]: r for r in jsonl(tmp_path / run / "training.jsonl")}
        assert sorted(records) == list(range(1, 11))  # the Trainer's logged steps, then ours
        assert records[7]["sample_ids"] == list(range(48, 56))  # the rows the Trainer would take next
        _assert_close({s: r["loss"] for s, r in records.items()}, continued)


def _as_fsdp_layout(checkpoint: Path, out: Path) -> None:
    """``checkpoint`` (the Trainer's checkpoint-6) as the Trainer saves it under FSDP with a sharded state dict:
    ``pytorch_model_fsdp_0/`` and ``optimizer_0/`` written by DCP as accelerate's ``save_fsdp_model`` and
    ``save_fsdp_optimizer`` write them (``{"model": ...}``, ``{"optimizer": ...}``, parameters named)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from transformers import AutoModelForCausalLM, Trainer

    shutil.copytree(checkpoint, out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    decay = set(Trainer.get_decay_parameter_names(None, model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW([{"params": [p for n, p in named if n in decay]},
                                   {"params": [p for n, p in named if n not in decay]}])
    optimizer.load_state_dict(torch.load(out / "optimizer.pt", weights_only=True))
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=out / "pytorch_model_fsdp_0", no_dist=True)
    dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=out / "optimizer_0",
             no_dist=True)
    for name in ("model.safetensors", "optimizer.pt"):
        (out / name).unlink()


def test_an_hf_trainer_fsdp_checkpoint_continues_here(tmp_path, assets, hf_run):
    checkpoint, recipe, continued, _ = hf_run
    _as_fsdp_layout(checkpoint, tmp_path / "checkpoint-6")
    done = _import(tmp_path, assets, tmp_path / "checkpoint-6", recipe)
    assert done.returncode == 0, done.stderr[-3000:]
    ckpt_train(tmp_path, assets, "--checkpoint.checkpoint_dir", "run", recipe=recipe)
    _assert_close(_losses(tmp_path / "run"), continued)


def test_a_lightning_run_continues_here(tmp_path, assets):
    """Into a recipe without its cosine schedule: the printed command continues it, no override typed."""
    recipe = _plain_recipe(tmp_path / "plain", assets, max_steps=ft.STEPS)
    rows = ft.recipe_rows(recipe)
    # the checkpoint of step 6 of an uninterrupted run, which is the reference: Lightning's own resume from it
    # restarts the epoch of a plain DataLoader
    def handed_on() -> dict[str, str]:  # what a command is given of the variables read at import
        return {k: v for k, v in harness._handed_on(dict(os.environ)).items() if k.startswith(warm_launch.IMPORT_TIME)}

    before = handed_on()
    straight = ft.lightning_fit(rows, assets, ft.STEPS, save=tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*.ckpt")) == ["six.ckpt"]
    # Lightning ran in this process (its import sets a PYTORCH_* variable): later commands still fork warm
    assert handed_on() == before
    done = _import(tmp_path, assets, tmp_path / "six.ckpt", recipe)
    written = _continued_with_the_printed_command(done)
    assert "Lightning records no random generators' state" in done.stdout
    assert "lr_scheduler = {'_target_': 'automodel_ckpt.training.lr.cosine_annealing', 't_max': 10" in done.stdout
    ckpt_train(tmp_path, assets, recipe=tmp_path / written)
    _assert_close(_losses(tmp_path / "run"), straight)


def test_a_lightning_distributed_checkpoint_continues_here(tmp_path, assets):
    """Lightning's ModelParallelStrategy (FSDP2, gloo, two CPU processes) writes six.ckpt/ as a distributed
    checkpoint folder; imported, ours continues as Lightning's uninterrupted run does, OneCycleLR's lr and beta1
    included."""
    import sys

    recipe = ft.write_recipe(tmp_path, assets, ft.ONE_CYCLE)
    fit = run_command([sys.executable, "-m", "tests.integration.foreign_trainers", "lightning-sharded", str(recipe),
                       str(assets), str(tmp_path)], cwd=Path(__file__).resolve().parents[2], env=env_for(assets),
                      timeout=600)
    assert fit.returncode == 0, fit.stderr[-3000:]
    folder = tmp_path / "six.ckpt"
    assert folder.is_dir() and (folder / ".metadata").is_file() and (folder / "meta.pt").is_file()
    assert sorted(p.name for p in folder.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]  # a file per rank
    straight = {int(k): v for k, v in json.loads((tmp_path / "losses.json").read_text()).items()}
    done = _import(tmp_path, assets, folder, recipe)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Imported Lightning distributed checkpoint (step 6) as run/epoch_0_step_6" in done.stdout
    ckpt_train(tmp_path, assets, "--checkpoint.checkpoint_dir", "run", recipe=recipe)
    _assert_close(_losses(tmp_path / "run"), straight)


def test_our_run_continues_in_the_hf_trainer(tmp_path, assets):
    """Ours with AdamWNoDecay's two groups, exported, continues in the Trainer (weight decay but for biases and
    norms, as ours)."""
    recipe = ft.write_recipe(tmp_path, assets, ft.HF_LINEAR, decay=True)
    ckpt_train(tmp_path, assets, "--checkpoint.checkpoint_dir", "ours", "--step_scheduler.ckpt_every_steps", "6",
               recipe=recipe)
    out = tmp_path / "hf" / "checkpoint-6"
    done = run_command([CKPT_TRAIN, "export", str(tmp_path / "ours" / "epoch_0_step_6"), "--to", "hf-trainer",
                        "--recipe", str(recipe), "--out", str(out)], cwd=tmp_path, env=env_for(assets), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "lr_scheduler_type='linear'" in done.stdout and "warmup_steps=2" in done.stdout
    assert f"weight_decay={ft.DECAY}" in done.stdout
    losses = ft.LossTrainer(tmp_path / "hf", ft.recipe_rows(recipe), assets, weight_decay=ft.DECAY).train(resume=out)
    _assert_close(losses, _losses(tmp_path / "ours"))


def test_an_hf_trainer_lora_run_continues_here(tmp_path, assets):
    recipe = ft.write_recipe(tmp_path, assets, ft.HF_LINEAR, lora=True)
    rows = ft.recipe_rows(recipe)
    ft.LossTrainer(tmp_path / "out", rows, assets, lora=True).train()
    checkpoint = tmp_path / "out" / "checkpoint-6"
    assert (checkpoint / "adapter_model.safetensors").is_file()
    continued = ft.LossTrainer(tmp_path / "again", rows, assets, lora=True).train(resume=checkpoint)
    done = _import(tmp_path, assets, checkpoint, recipe)
    assert done.returncode == 0, done.stderr[-3000:]
    # and back: the imported checkpoint exported as an adapter checkpoint-6 that the Trainer continues
    back = tmp_path / "back" / "checkpoint-6"
    done = run_command([CKPT_TRAIN, "export", str(tmp_path / "run" / "epoch_0_step_6"), "--to", "hf-trainer",
                        "--recipe", str(recipe), "--out", str(back)], cwd=tmp_path, env=env_for(assets), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (back / "adapter_model.safetensors").is_file() and not (back / "model.safetensors").exists()
    _assert_close(ft.LossTrainer(tmp_path / "back", rows, assets, lora=True).train(resume=back), continued)
    ckpt_train(tmp_path, assets, "--checkpoint.checkpoint_dir", "run", recipe=recipe)
    _assert_close(_losses(tmp_path / "run"), continued)


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _payload(folder: Path, marker: Path) -> None:
    import torch

    torch.save({"last_epoch": 6, "base_lrs": _Payload(marker)}, folder / "scheduler.pt")


def _spoil_optimizer(folder: Path, change) -> None:
    import torch

    opt = torch.load(folder / "optimizer.pt", weights_only=True)
    change(opt["state"])
    torch.save(opt, folder / "optimizer.pt")


def _spoil_args(folder: Path) -> None:
    import torch

    args = torch.load(folder / "training_args.bin", weights_only=False)  # the test's own file
    args.lr_scheduler_type = "polynomial"
    torch.save(args, folder / "training_args.bin")


def _absurd_state(folder: Path) -> None:
    state = json.loads((folder / "trainer_state.json").read_text())
    state["global_step"] = 10**30
    (folder / "trainer_state.json").write_text(json.dumps(state))


HOSTILE = {
    "pickle payload": (_payload, "scheduler.pt"),
    "moment of the wrong shape": (lambda f, marker: _spoil_optimizer(f, lambda s: s[0].update(
        exp_avg=s[0]["exp_avg"][:1])), "exp_avg for 'model.embed_tokens.weight' (slot 0) is"),
    "missing moment": (lambda f, marker: _spoil_optimizer(f, lambda s: s[3].pop("exp_avg_sq")), "has no exp_avg_sq"),
    "schedule we do not have": (lambda f, marker: _spoil_args(f), "'polynomial' schedule has no counterpart"),
    "absurd counts": (lambda f, marker: _absurd_state(f), "global_step is"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_source_is_refused_in_one_line(tmp_path, assets, hf_run, case):
    checkpoint, recipe, _, _ = hf_run
    spoiled, marker = tmp_path / "checkpoint-6", tmp_path / "marker"
    shutil.copytree(checkpoint, spoiled)
    spoil, expected = HOSTILE[case]
    spoil(spoiled, marker)
    done = _import(tmp_path, assets, spoiled, recipe)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], done.stderr[-2000:]
    assert not marker.exists()
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").glob("epoch_*"))


def test_a_lightning_file_with_a_payload_is_refused_in_one_line(tmp_path, assets, hf_run):
    import torch

    _, recipe, _, _ = hf_run
    marker = tmp_path / "marker"
    torch.save({"state_dict": {}, "global_step": 1, "hyper_parameters": _Payload(marker)}, tmp_path / "last.ckpt")
    done = _import(tmp_path, assets, tmp_path / "last.ckpt", recipe)
    assert done.returncode != 0 and done.stderr.startswith("error: refusing") and "last.ckpt" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not marker.exists() and not (tmp_path / "run").exists()
