"""Lineage across runs and exports: an SFT run, a DPO run started from its checkpoint's export, a GGUF export of the
DPO checkpoint; `inspect --lineage` of the GGUF names each link back to the base model by path and fingerprint, and
still prints with the SFT run folder gone, naming the missing link. One launch of each, shared by the assertions."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from automodel_ckpt.ondisk import catalog, layout
from tests.integration.harness import CKPT_TRAIN, REPO, ckpt_train, env_for, run_command

SMALL = ("--dataset.num_samples", "64", "--step_scheduler.global_batch_size", "8",
         "--step_scheduler.local_batch_size", "8", "--step_scheduler.max_steps", "2",
         "--step_scheduler.ckpt_every_steps", "2", "--step_scheduler.val_every_steps", "100")


def _inspect(work: Path, assets: Path, target: Path):
    done = run_command([CKPT_TRAIN, "inspect", str(target), "--lineage"], cwd=work, env=env_for(assets), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def chain(tmp_path_factory, assets):
    work = tmp_path_factory.mktemp("lineage")
    ckpt_train(work, assets, *SMALL, "--data.val_size", "8", "--checkpoint.checkpoint_dir", "sft")
    sft = catalog.latest_checkpoint(work / "sft")
    export = sft / layout.MODEL_DIR / layout.CONSOLIDATED_DIR
    assert (export / layout.HF_CONFIG).is_file()
    ckpt_train(work, assets, *SMALL, "--validation_dataset.num_samples", "8", "--checkpoint.checkpoint_dir", "dpo",
               "--model.pretrained_model_name_or_path", str(export), "--model.embedded", "null",
               recipe=REPO / "recipes" / "tiny_llama_dpo.yaml")
    dpo = catalog.latest_checkpoint(work / "dpo")
    gguf = work / "dpo.gguf"
    done = run_command([CKPT_TRAIN, "export", str(dpo), "--to", "gguf", "--out", str(gguf), "--no-progress"],
                       cwd=work, env=env_for(assets), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    shown = _inspect(work, assets, gguf)
    return work, sft, export, dpo, gguf, shown


def test_the_gguf_names_every_link_back_to_the_base_model(chain, assets):
    work, sft, export, dpo, gguf, shown = chain
    from automodel_ckpt.export import lineage_fingerprint as fingerprint

    print(shown)
    lines = shown.splitlines()
    assert lines[0].startswith(f"lineage of '{gguf}' (sha256:")
    expected = [("exported from", dpo), ("base model", export), ("exported from", sft),
                ("base model", assets / "tiny_llama_base")]
    at = 0
    for role, path in expected:  # in order, each a generation deeper
        found = [i for i, line in enumerate(lines) if line.strip().startswith(f"{role}: {path} (")]
        assert found and found[0] > at, (role, path, shown)
        line = lines[found[0]]
        assert fingerprint(path, follow=True) in line and line.endswith("[present]"), line
        at = found[0]
    assert "training data: sha256:" in shown
    meta = json.loads((dpo / layout.METADATA_FILE).read_text())
    assert [p["role"] for p in meta["lineage"]["parents"]] == ["base model"]


def test_with_the_sft_run_gone_the_chain_prints_and_names_the_missing_link(chain, assets):
    work, sft, export, dpo, gguf, shown = chain
    shutil.rmtree(work / "sft")
    after = _inspect(work, assets, gguf)
    print(after)
    gone = [line for line in after.splitlines() if line.endswith("[gone]")]
    assert any(line.strip().startswith(f"base model: {export} (sha256:") for line in gone), after
    assert any(line.strip().startswith(f"exported from: {sft} (sha256:") for line in gone), after
    assert f"base model: {assets / 'tiny_llama_base'}" in after  # recorded: the chain goes on past the gap
