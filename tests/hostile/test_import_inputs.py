"""`ckpt-train import` of a hostile source: no link followed, no file read past its bound, no value taken unchecked.

Three tiny genuine sources are crafted once per module, as the HF Trainer and Lightning write them, for a recipe whose
model (a one-layer Llama built from ``model.config``) holds some 13,000 parameters: a Trainer ``checkpoint-N/``, a
Lightning ``.ckpt`` and a Lightning distributed checkpoint folder. Each case copies one and tampers one file: a link
out of it (a file, a folder on the way, a data file of the DCP folder) or inside it, a FIFO, a sparse file far larger
than the recipe's model allows (8 GiB for a ``.ckpt``, a shard or the weights), a value of the Trainer's log history
that is no finite number. Run through the corpus's limited child processes: one ``error:`` line naming the file,
non-zero exit, no traceback or memory error, nothing outside opened or copied in (inotify, snapshot), no run folder
written, and for the large files a peak memory within 150 MiB of an idle child's.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.hostile.conftest import CODE, Case
from tests.hostile.harness import Outside, lean, refused

SFT = CODE / "recipes" / "tiny_llama_sft.yaml"
MODEL = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
         "num_attention_heads": 2, "num_key_value_heads": 1, "tie_word_embeddings": False}
HUGE = 8 * 2**30  # sparse: no disk space, but a reader that trusted it would allocate it all
BIG = 200 * 2**20
SHARD = "__0_0.distcp"
FIFO_TIMEOUT = 30


def _recipe(folder: Path) -> Path:
    """The tiny_llama_sft recipe with its model built from ``MODEL`` (no base folder to read)."""
    text = SFT.read_text().replace("  pretrained_model_name_or_path: ${oc.env:AUTOMODEL_CKPT_ASSETS,assets}/"
                                   "tiny_llama_base\n  embedded: tiny_llama\n",
                                   f"  pretrained_model_name_or_path: null\n  config: {json.dumps(MODEL)}\n")
    assert "config:" in text
    path = folder / "recipe.yaml"
    path.write_text(text)
    return path


def _trained():
    """The model, its AdamW after one step, as both trainers hold them."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in MODEL.items() if k != "model_type"}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    model(input_ids=torch.arange(8).view(1, 8), labels=torch.arange(8).view(1, 8)).loss.backward()
    opt.step()
    return model, opt


def _hf_trainer(folder: Path, model, opt) -> Path:
    """A Trainer's ``checkpoint-1/`` of the linear schedule, at step 1 of 4."""
    import random

    import numpy as np
    import torch
    from safetensors.torch import save_file
    from transformers import TrainingArguments

    folder.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    torch.save(opt.state_dict(), folder / "optimizer.pt")
    torch.save({"last_epoch": 1, "base_lrs": [1e-3], "_last_lr": [7.5e-4]}, folder / "scheduler.pt")
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.get_rng_state()},
               folder / "rng_state.pth")
    torch.save(TrainingArguments(output_dir=str(folder.parent / "out"), learning_rate=1e-3, max_steps=4,
                                 lr_scheduler_type="linear", warmup_steps=0, per_device_train_batch_size=4,
                                 report_to=[], use_cpu=True), folder / "training_args.bin")
    (folder / "trainer_state.json").write_text(json.dumps({
        "global_step": 1, "max_steps": 4, "train_batch_size": 4, "epoch": 0.25,
        "log_history": [{"epoch": 0.25, "step": 1, "loss": 4.2, "learning_rate": 7.5e-4, "grad_norm": 1.5}]}))
    return folder


def _lightning(path: Path, model, opt) -> Path:
    import torch

    torch.save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}, "global_step": 1,
                "optimizer_states": [opt.state_dict()], "lr_schedulers": [], "loops": {}}, path)
    return path


def _lightning_folder(folder: Path, model, opt) -> Path:
    """What ModelParallelStrategy saves: the weights (``state_dict.``) and ``optimizer_0`` by DCP, and ``meta.pt``."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    module = torch.nn.Module()
    module.model = model
    state = {"state_dict": get_model_state_dict(module), "optimizer_0": get_optimizer_state_dict(module, opt)}
    dcp.save(state, checkpoint_id=folder, no_dist=True)
    torch.save({"global_step": 1, "lr_schedulers": [], "loops": {}}, folder / "meta.pt")
    assert (folder / SHARD).is_file()
    return folder


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import warnings

    root = tmp_path_factory.mktemp("import_sources")
    model, opt = _trained()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's note that it saves in one process
        made = {"trainer": _hf_trainer(root / "checkpoint-1", model, opt),
                "ckpt": _lightning(root / "last.ckpt", model, opt),
                "folder": _lightning_folder(root / "epoch=0-step=1.ckpt", model, opt)}
    return {**made, "recipe": _recipe(root)}


def test_the_genuine_sources_are_read(sources):
    """Every case below changes one thing of a source that the import reads whole."""
    from automodel_ckpt.cli.import_run import source_limits
    from automodel_ckpt.config.loader import load_config
    from automodel_ckpt.config.schema import RecipeConfig
    from automodel_ckpt.interop import read_source

    limits = source_limits(load_config(str(sources["recipe"]), [], RecipeConfig))
    assert limits.checkpoint < 64 * 2**20
    for kind in ("trainer", "ckpt", "folder"):
        run = read_source(sources[kind], limits)
        assert run.step == 1 and run.weights, kind
    assert read_source(sources["trainer"], limits).log[0]["lr"] == 7.5e-4


# --- the tampering ---------------------------------------------------------------------------------------------------


def link_out(rel: str):
    """``rel`` a symlink to the file outside."""
    def tamper(src: Path, outside: Outside) -> None:
        (src / rel).unlink()
        os.symlink(outside.secret, src / rel)
    return tamper


def link_inside(rel: str):
    """``rel`` a symlink to its own bytes moved beside it: a link that stays inside is not followed either."""
    def tamper(src: Path, outside: Outside) -> None:
        (src / rel).rename(src / f"{rel}.real")
        os.symlink(f"{rel}.real", src / rel)
    return tamper


def linked_folder(inside: bool):
    """The weights named by an index as ``shards/model.safetensors``, ``shards`` a symlink to a folder outside or
    (``inside``) to the folder beside it that holds them."""
    def tamper(src: Path, outside: Outside) -> None:
        if inside:
            (src / "real").mkdir()
            (src / "model.safetensors").rename(src / "real" / "model.safetensors")
        else:
            (src / "model.safetensors").unlink()
        os.symlink("real" if inside else outside.dir, src / "shards")
        (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
            "lm_head.weight": "shards/model.safetensors"}}))
    return tamper


def linked_fsdp_folder(src: Path, outside: Outside) -> None:
    os.symlink(outside.dir, src / "pytorch_model_fsdp_0")


def fifo(rel: str):
    def tamper(src: Path, outside: Outside) -> None:
        (src / rel).unlink()
        os.mkfifo(src / rel)
    return tamper


def sparse(rel: str, size: int):
    """``rel`` grown to ``size`` bytes of holes after its own."""
    def tamper(src: Path, outside: Outside) -> None:
        with open(src / rel if rel else src, "r+b") as f:
            f.truncate(size)
    return tamper


def logged(key: str, value: object):
    """The first entry of the Trainer's log history with ``key`` set to ``value`` (NaN written as JSON's ``NaN``)."""
    def tamper(src: Path, outside: Outside) -> None:
        state = json.loads((src / "trainer_state.json").read_text())
        state["log_history"][0][key] = value
        (src / "trainer_state.json").write_text(json.dumps(state))
    return tamper


# label -> (source, tamper, texts of the error line, a large file: memory checked)
LINKS = {
    "trainer_state.json linked outside": ("trainer", link_out("trainer_state.json"), ["trainer_state.json", "symlink"]),
    "scheduler.pt linked outside": ("trainer", link_out("scheduler.pt"), ["scheduler.pt", "symlink"]),
    "rng_state.pth linked outside": ("trainer", link_out("rng_state.pth"), ["rng_state.pth", "symlink"]),
    "optimizer.pt linked inside": ("trainer", link_inside("optimizer.pt"), ["optimizer.pt", "symlink"]),
    "weights through a folder linked outside": ("trainer", linked_folder(False), ["'shards/model.safetensors'",
                                                                                 "symlink"]),
    "weights through a folder linked inside": ("trainer", linked_folder(True), ["symlinked folder 'shards'"]),
    "FSDP model folder linked outside": ("trainer", linked_fsdp_folder, ["pytorch_model_fsdp_0", "symlink"]),
    "meta.pt linked outside": ("folder", link_out("meta.pt"), ["meta.pt", "symlink"]),
    "DCP data file linked outside": ("folder", link_out(SHARD), [SHARD, "symlink"]),
    "DCP data file linked inside": ("folder", link_inside(SHARD), [SHARD, "symlink"]),
}
FIFOS = {
    "trainer_state.json a FIFO": ("trainer", fifo("trainer_state.json"), ["trainer_state.json", "FIFO"]),
    "optimizer.pt a FIFO": ("trainer", fifo("optimizer.pt"), ["optimizer.pt", "FIFO"]),
    "meta.pt a FIFO": ("folder", fifo("meta.pt"), ["meta.pt", "FIFO"]),
    ".metadata a FIFO": ("folder", fifo(".metadata"), [".metadata", "FIFO"]),
}
SIZES = {
    "an 8 GiB .ckpt": ("ckpt", sparse("", HUGE), ["last.ckpt", "8.0 GiB, over the", "recipe's model"]),
    "an 8 GiB DCP data file": ("folder", sparse(SHARD, HUGE), ["its data files", "over the", "recipe's model"]),
    "8 GiB of weights": ("trainer", sparse("model.safetensors", HUGE), ["its weight files", "over the"]),
    "8 GiB of optimizer state": ("trainer", sparse("optimizer.pt", HUGE), ["optimizer.pt", "over the"]),
    "a 200 MiB trainer_state.json": ("trainer", sparse("trainer_state.json", BIG), ["trainer_state.json",
                                                                                   "over the 64.0 MiB"]),
    "a 200 MiB scheduler.pt": ("trainer", sparse("scheduler.pt", BIG), ["scheduler.pt", "over the 1.0 MiB"]),
}
VALUES = {
    "a string for the learning rate": ("trainer", logged("learning_rate", "1e-3"),
                                       ["trainer_state.json", "log_history[0].learning_rate", "not a finite number"]),
    "a NaN loss": ("trainer", logged("loss", float("nan")), ["trainer_state.json", "log_history[0].loss"]),
    "an infinite grad norm": ("trainer", logged("grad_norm", float("inf")), ["log_history[0].grad_norm"]),
    "a list for the grad norm": ("trainer", logged("grad_norm", [1.0, 2.0]), ["log_history[0].grad_norm"]),
    "a string loss": ("trainer", logged("loss", "low"), ["log_history[0].loss"]),
}
CASES = {**LINKS, **FIFOS, **SIZES, **VALUES}


@pytest.fixture
def import_case(server, assets, sources, tmp_path):
    made: list[Case] = []

    def make(kind: str) -> tuple[Case, Path]:
        case = Case(server, assets, tmp_path / "work", Outside(tmp_path / "outside"))
        case.work.mkdir()
        made.append(case)
        src = case.work / sources[kind].name
        (shutil.copytree if sources[kind].is_dir() else shutil.copyfile)(sources[kind], src)
        return case, src

    yield make
    for case in made:
        case.outside.close()


@pytest.mark.parametrize("label", CASES)
def test_a_hostile_source_is_refused_in_one_line_before_anything_is_built(import_case, sources, label):
    kind, tamper, expected = CASES[label]
    case, src = import_case(kind)
    tamper(src, case.outside)
    outcome = case.verb("import", src, sources["recipe"], "--out", case.work / "run", timeout=FIFO_TIMEOUT)
    refused(outcome, *expected)
    if label in SIZES:
        lean(outcome, case.server.rss)
    assert not (case.work / "run").exists(), f"a run folder was written:\n{outcome}"
