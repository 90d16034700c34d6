"""A real torchtitan run (its Llama 3 in the tiny Llama's shape, FSDP2 on 2 CPU ranks, gloo, its CheckpointManager)
imported and continued here on 1 and on 3 processes: its weights and every AdamW moment bitwise torchtitan's own
``to_hf`` of them, its schedule's lr at steps 7-10, the logits round trip exact, its own next losses within 1e-5."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from tests.integration import foreign_trainers as ft
from tests.integration import forked_ranks
from tests.integration import torchtitan_run as ttr
from tests.integration.harness import CKPT_TRAIN, ckpt_train, env_for, jsonl, run_command

pytest.importorskip("torchtitan")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def titan(tmp_path_factory, assets):
    """The run (``dump/``: ``checkpoint/step-6/`` and ``job_config.json``; ``reference.json``, ``logits.pt``,
    ``theirs.pt``) and its import (``run/``, ``import.out``), each made when a test first asks for it."""
    folder = tmp_path_factory.mktemp("torchtitan")
    made: dict[str, Path] = {}

    def recipe() -> Path:
        if "recipe" not in made:
            made["recipe"] = ft.write_recipe(folder, assets, ft.HF_LINEAR)
            made["recipe"].write_text(made["recipe"].read_text()
                                      .replace("global_batch_size: 8", f"global_batch_size: {ttr.BATCH}")
                                      .replace("local_batch_size: 8", f"local_batch_size: {ttr.BATCH}"))
        return made["recipe"]

    def run() -> Path:
        if "run" not in made:
            out = folder / "source"
            out.mkdir()
            done = forked_ranks.launch(2, Path(ttr.__file__), str(recipe()), str(assets), str(out),
                                       env=env_for(assets), preload=ttr.PRELOAD)
            assert done.returncode == 0, done.stderr[-3000:]
            made["run"] = out
        return made["run"]

    def imported() -> Path:
        if "imported" not in made:
            source = run()
            done = run_command([CKPT_TRAIN, "import", str(source / "dump"), str(recipe()), "--out", "run", "--check"],
                               cwd=folder, env=env_for(assets), timeout=600)
            assert done.returncode == 0, done.stderr[-3000:]
            (folder / "import.out").write_text(done.stdout)
            made["imported"] = folder
        return made["imported"]

    return run, imported, recipe


def _weights(checkpoint: Path) -> dict:
    from safetensors.torch import load_file

    weights = {}
    for shard in sorted((checkpoint / "model").glob("*.safetensors")):
        weights.update(load_file(str(shard)))
    return weights


def test_a_torchtitan_step_folder_reads_as_torchtitan_s_own_to_hf(assets, titan):
    """Read in this process (its dump folder): the weights and moments, in the HF Llama's layout once the model is
    known, bitwise those that torchtitan's own code gives."""
    import torch
    from transformers import AutoModelForCausalLM

    from automodel_ckpt.cli.import_run import source_limits
    from automodel_ckpt.config.loader import load_config
    from automodel_ckpt.config.schema import RecipeConfig
    from automodel_ckpt.interop import read_source

    run, _, recipe = titan
    source = run()
    titan_run = read_source(source / "dump", source_limits(load_config(str(recipe()), [], RecipeConfig)))
    assert titan_run.kind == "torchtitan checkpoint (step 6, 2 ranks)" and titan_run.global_batch == ttr.BATCH
    model = AutoModelForCausalLM.from_pretrained(assets / "tiny_llama_base", dtype=torch.float32)
    titan_run.fit(model)
    theirs = torch.load(source / "theirs.pt", weights_only=True)
    assert sorted(titan_run.weights) == sorted(theirs["weights"])
    assert all(torch.equal(titan_run.weights[n], t) for n, t in theirs["weights"].items())
    for name, slot in zip(titan_run.order(model), titan_run.moments):
        assert all(torch.equal(slot[k], theirs[k][name]) for k in ("exp_avg", "exp_avg_sq")), name


def test_a_torchtitan_run_imports_with_its_weights_and_moments_bitwise(titan):
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    run, imported, _ = titan
    source, folder = run(), imported()
    printed = (folder / "import.out").read_text()
    assert "Imported torchtitan checkpoint (step 6, 2 ranks) as run/epoch_0_step_6" in printed
    assert "largest difference 0, bitwise equal" in printed, printed
    assert ("lr_scheduler = {'_target_': 'automodel_ckpt.training.lr.wsd', 'warmup_steps': 2, 'decay_steps': 8, "
            "'min_lr_ratio': 0.1, 'decay': 'cosine'}") in printed

    # the weights and every moment bitwise torchtitan's own: its adapter's to_hf, its fused QKV split
    checkpoint = folder / "run" / "epoch_0_step_6"
    weights = _weights(checkpoint)
    dcp_to_torch_save(str(checkpoint / "optim"), str(folder / "optim.pt"))
    state = torch.load(folder / "optim.pt", weights_only=True)["state"]
    theirs = torch.load(source / "theirs.pt", weights_only=True)
    ft.assert_imported_as_theirs(weights, state, theirs, 6)


def test_the_logits_of_an_imported_torchtitan_run_round_trip(assets, titan):
    import torch
    from transformers import AutoModelForCausalLM

    from automodel_ckpt.interop.check import probe_inputs

    run, imported, _ = titan
    source, checkpoint = run(), imported() / "run" / "epoch_0_step_6"
    # the way back: torchtitan's model holding the imported weights (its from_hf) has its logits, bitwise
    back = imported() / "back.pt"
    done = run_command([sys.executable, "-m", "tests.integration.torchtitan_run", "--logits", str(assets),
                        str(checkpoint), str(back)], cwd=REPO, env=env_for(assets), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert torch.equal(torch.load(back), torch.load(source / "logits.pt"))
    # the HF Llama holding them: torchtitan's logits but for the last bits of another RoPE and attention
    model = AutoModelForCausalLM.from_pretrained(assets / "tiny_llama_base", dtype=torch.float32)
    model.load_state_dict(_weights(checkpoint))
    with torch.no_grad():
        logits = model(input_ids=probe_inputs(model.config.vocab_size)).logits
    gap = (logits - torch.load(source / "logits.pt")).abs().max().item()
    print("largest logit difference from torchtitan's model:", gap)  # shown with -s
    assert gap < 1e-5


@pytest.mark.parametrize("nproc", [1, 3])
def test_an_imported_torchtitan_run_continues_at_another_world_size(tmp_path, assets, titan, nproc):
    run, imported, _ = titan
    reference = json.loads((run() / "reference.json").read_text())
    shutil.copytree(imported() / "run", tmp_path / "run")
    args = () if nproc == 1 else ("--step_scheduler.local_batch_size", str(ttr.BATCH // nproc))
    ckpt_train(tmp_path, assets, *args, recipe=tmp_path / "run" / "recipe.yaml", nproc=nproc)
    records = {r["step"]: r for r in jsonl(tmp_path / "run" / "training.jsonl")}
    assert sorted(records) == list(range(7, 11))
    for step in range(7, 11):
        assert records[step]["lr"] == pytest.approx(reference["lr"][str(step)], rel=1e-9), step
    gaps = [abs(records[s]["loss"] - reference["loss"][str(s)]) for s in range(7, 11)]
    print("largest loss difference from torchtitan's own continuation:", max(gaps))  # shown with -s
    assert max(gaps) < 1e-5, (gaps, records, reference)
