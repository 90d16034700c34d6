"""The model is built on the meta device and each rank materialises its own shards, end to end on 1 and 2 processes.

Every run writes, per rank, what its materialisation held and read (``AUTOMODEL_CKPT_LOAD_RECORD``). With ``lr: 0``
the weights stay as they were loaded, so the checkpoint holds the starting weights themselves.
"""

from __future__ import annotations

import json
import shutil
from functools import cache
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from automodel_ckpt.ondisk import layout
from automodel_ckpt.models.materialize import RECORD_ENV
from tests.family_bases import row_shares
from tests.integration.harness import ckpt_train, losses

FAST = ("--optimizer.lr", "0", "--dataset.num_samples", "400", "--data.val_size", "16",
        "--step_scheduler.val_every_steps", "null", "--step_scheduler.global_batch_size", "8",
        "--step_scheduler.local_batch_size", "4", "--step_scheduler.ckpt_every_steps", "1",
        "--checkpoint.save_consolidated", "final")  # fmt: skip
#: FSDP2 whatever the model's size (``auto`` would replicate this one): each rank materialises and reads its shards
SHARDED = ("--distributed.dp_shard", "full")
CONFIG = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
          "num_key_value_heads": 1, "vocab_size": 49, "tie_word_embeddings": True}  # fmt: skip


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("meta")


@cache
def _run(work: Path, assets: Path, name: str, nproc: int, steps: int, *args: str) -> tuple[Path, list[dict]]:
    """Run ``name`` (again, if its folder exists: a resume); returns its folder and each rank's load record."""
    record = work / f"{name}.record{len(list(work.glob(name + '.record*')))}"
    ckpt_train(work, assets, *FAST, "--checkpoint.checkpoint_dir", name, "--step_scheduler.max_steps", str(steps),
               *args, nproc=nproc, env={RECORD_ENV: str(record)})
    return work / name, [json.loads((record / f"rank{r}.json").read_text()) for r in range(nproc)]


def _base_files(assets: Path) -> list[Path]:
    return sorted((assets / "tiny_llama_base").glob("*.safetensors"))


def _exported(run: Path, step: int) -> dict[str, torch.Tensor]:
    folder = run / f"epoch_0_step_{step}" / layout.MODEL_DIR / "consolidated"
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_each_rank_reads_only_its_slices_of_the_base_and_never_holds_a_whole_sharded_parameter(work, assets):
    run, records = _run(work, assets, "folder", 2, 2, *SHARDED)
    data_bytes, share = row_shares(assets / "tiny_llama_base", 2)
    read = [r["base_bytes_read"] for r in records]
    assert all(0 < n <= share for n in read), (read, share, data_bytes)
    assert sum(read) == data_bytes  # every byte of tensor data read once, by one rank
    for rank, record in enumerate(records):
        whole = [p["name"] for p in record["params"] if p["sharded"] and p["local"] == p["numel"]]
        assert not whole, f"rank {rank} holds whole sharded parameters: {whole}"
        assert sum(p["local"] for p in record["params"]) < 0.6 * sum(p["numel"] for p in record["params"])
    base = {k: v for f in _base_files(assets) for k, v in load_file(f).items()}
    exported = _exported(run, 2)
    assert exported.keys() == base.keys()
    assert all(torch.equal(exported[k], base[k]) for k in base)  # lr 0: the weights are the base's, bit for bit


def test_a_resume_never_reads_the_base_even_after_falling_back_past_a_damaged_checkpoint(work, assets):
    first, _ = _run(work, assets, "folder", 2, 2, *SHARDED)
    run = work / "fallback"
    shutil.copytree(first, run, symlinks=True)
    for shard in (run / "epoch_0_step_2" / layout.MODEL_DIR).glob("*.safetensors"):
        shard.unlink()  # the newest checkpoint is damaged: the run resumes from step 1's
    _, records = _run(work, assets, "fallback", 2, 3)
    assert all("base_bytes_read" not in r for r in records)
    assert losses(run)[:2] == losses(first)[:2]


def test_with_every_checkpoint_damaged_the_run_starts_fresh_from_the_base(work, assets):
    first, _ = _run(work, assets, "folder", 2, 2, *SHARDED)
    run = work / "fresh"
    shutil.copytree(first, run, symlinks=True)
    for step in (1, 2):
        for shard in (run / f"epoch_0_step_{step}" / layout.MODEL_DIR).glob("*.safetensors"):
            shard.unlink()
    _, records = _run(work, assets, "fresh", 2, 2)
    assert all(r["base_bytes_read"] > 0 for r in records)
    assert losses(run) == losses(first)


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_config_built_model_starts_from_the_seeded_build_at_every_world_size(work, assets, nproc):
    from automodel_ckpt.models.build import build_causal_lm

    model_args = ("--model.pretrained_model_name_or_path", "null", "--model.embedded", "null",
                  "--model.config", json.dumps(CONFIG),
                  "--tokenizer.pretrained_model_name_or_path", str(assets / "tiny_llama_base"))  # fmt: skip
    run, records = _run(work, assets, f"config{nproc}", nproc, 1, *model_args)
    reference = build_causal_lm(config=dict(CONFIG)).state_dict()
    exported = _exported(run, 1)
    assert exported and all(torch.equal(v, reference[k]) for k, v in exported.items())
    assert "lm_head.weight" not in exported  # tied: written once, as save_pretrained does
    if nproc == 2:
        assert all(p["local"] < p["numel"] for r in records for p in r["params"] if p["sharded"])
