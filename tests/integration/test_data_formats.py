"""Data as users have it, end to end: chat on 2 processes with exact resume and a cached second start, column
templates from YAML, the real-model recipes on tiny same-family models, `preview`, and `--dry-run` of every recipe."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest
import yaml

from automodel_ckpt import cli
from tests.integration import families
from tests.integration.harness import REPO, ckpt_train, jsonl, losses

RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
# Real-model recipes: (tiny stand-in family, data shape); only paths (and the run's length) are overridden.
REAL = {"llama3_2_1b_squad.yaml": ("llama", families.squad),
        "llama3_2_1b_hellaswag_peft.yaml": ("llama", families.hellaswag),
        "qwen2_5_0_5b_instruct_chat.yaml": ("qwen2", families.word_chats),
        "llama3_2_1b_continued_pretraining.yaml": ("llama", families.texts),
        "qwen2_5_0_5b_instruct_dpo.yaml": ("qwen2", families.word_chat_pairs)}
SHORT = ("--step_scheduler.max_steps", "2", "--step_scheduler.ckpt_every_steps", "2",
         "--step_scheduler.global_batch_size", "8", "--step_scheduler.local_batch_size", "4",
         "--checkpoint.save_consolidated", "false")


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("data_formats")


def _cache(work: Path) -> tuple[str, str]:
    """The module's own tokenized-data cache (``data.cache_dir``): the first start here tokenizes."""
    return "--data.cache_dir", str(work / "tokenized")


@cache
def _family(work: Path, family: str) -> Path:
    return families.build_family_model(family, work / f"tiny_{family}")


@cache
def _data(work: Path, name: str, shape) -> tuple[Path, Path]:
    return (families.write_jsonl(work / "data" / f"{name}_train.jsonl", shape(200)),
            families.write_jsonl(work / "data" / f"{name}_val.jsonl", shape(8, seed=1)))


def _path_overrides(work: Path, recipe: str) -> list[str]:
    family, shape = REAL[recipe]
    train, val = _data(work, recipe.split(".")[0], shape)
    return ["--model.pretrained_model_name_or_path", str(_family(work, family)), "--dataset.path", str(train),
            "--validation_dataset.path", str(val)]


# ------------------------------------------------------------------------------ chat on 2 processes

def _chat_recipe(work: Path) -> Path:
    """The embedded chat recipe reading `messages` from a jsonl file, packed."""
    path = work / "chat.yaml"
    if not path.exists():
        cfg = yaml.safe_load((REPO / "recipes" / "tiny_llama_chat.yaml").read_text())
        chats = families.write_jsonl(work / "data" / "chats.jsonl", families.arithmetic_chats(400))
        cfg["dataset"] = {"_target_": "automodel_ckpt.data.files.load_local_dataset", "path": str(chats)}
        cfg["data"] = {"seq_length": 64, "packing": True, "val_size": 32, "chat_loss": "assistant"}
        cfg["step_scheduler"].update(global_batch_size=8, local_batch_size=4, max_steps=4, ckpt_every_steps=2,
                                     val_every_steps=2)
        cfg["checkpoint"]["save_consolidated"] = False
        path.write_text(yaml.safe_dump(cfg))
    return path


@cache
def _chat_runs(work: Path, assets: Path) -> dict[str, object]:
    recipe, cache = _chat_recipe(work), _cache(work)
    straight = ckpt_train(work, assets, *cache, "--checkpoint.checkpoint_dir", "chat_straight", recipe=recipe, nproc=2)
    first = ckpt_train(work, assets, *cache, "--checkpoint.checkpoint_dir", "chat_resumed",
                       "--step_scheduler.max_steps", "2", recipe=recipe, nproc=2)
    second = ckpt_train(work, assets, *cache, "--checkpoint.checkpoint_dir", "chat_resumed", recipe=recipe, nproc=2)
    return {"straight": straight, "first": first, "second": second}


def test_chat_trains_on_two_processes_and_resumes_bitwise(work, assets):
    runs = _chat_runs(work, assets)
    assert "Loading checkpoint from chat_resumed/epoch_0_step_2" in runs["second"].output
    straight = losses(work / "chat_straight")
    assert len(straight) == 4
    assert losses(work / "chat_resumed") == straight  # bitwise
    assert [r["val_loss"] for r in jsonl(work / "chat_resumed" / "validation.jsonl")] == \
           [r["val_loss"] for r in jsonl(work / "chat_straight" / "validation.jsonl")]


def test_a_second_start_reads_the_tokenization_cache(work, assets):
    runs = _chat_runs(work, assets)
    assert "tokenized in" in runs["straight"].stdout and "tokenization cached" not in runs["straight"].stdout
    for name in ("first", "second"):
        assert "tokenization cached" in runs[name].stdout, runs[name].stdout
    assert losses(work / "chat_resumed")[:2] == losses(work / "chat_straight")[:2]


def test_preview_marks_assistant_text_trained_and_the_rest_masked(work, assets, capsys, monkeypatch):
    monkeypatch.setenv("AUTOMODEL_CKPT_ASSETS", str(assets))
    monkeypatch.setattr("datasets.config.HF_DATASETS_CACHE", work / "hf_preview")
    assert cli.main(["preview", str(_chat_recipe(work)), "--num", "2"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("    <s>", "  + <s>"))]
    assert len(rows) >= 2
    for line in rows:  # system: add. user: 12+34? assistant: «46</s>»
        assert "«" in line and "system: add." in line.split("«")[0] and "user:" in line.split("«")[0]
        assert all(piece.split("»")[0].rstrip("</s>").isdigit() for piece in line.split("«")[1:])
    assert "train: 368 examples" in out and "truncated examples" in out and "packing efficiency" in out


def test_a_missing_template_field_is_a_one_line_error(work, capsys):
    recipe = "llama3_2_1b_squad.yaml"
    args = ["preview", str(REPO / "recipes" / recipe), *_path_overrides(work, recipe),
            "--data.completion_template", " {answers.txt[0]}"]
    capsys.readouterr()
    assert cli.main(args) == 2
    # In-process, the datasets library may already print progress bars above it; the error is the last line.
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: dataset: record 0 has no field 'answers.txt[0]'")
    assert sum(line.startswith("error:") for line in err) == 1


# ------------------------------------------------------------------- templates and real-model recipes

def _alpaca_recipe(work: Path) -> Path:
    path = work / "alpaca.yaml"
    if not path.exists():
        train, _ = _data(work, "alpaca", families.alpaca)
        cfg = yaml.safe_load((REPO / "recipes" / "llama3_2_1b_squad.yaml").read_text())
        cfg.pop("validation_dataset")
        cfg["dataset"] = {"_target_": "automodel_ckpt.data.files.load_local_dataset", "path": str(train)}
        cfg["data"] = {"prompt_template": "Instruction: {instruction} Input: {input} Response:",
                       "completion_template": " {output}", "seq_length": 64, "val_size": 8}
        cfg["model"]["pretrained_model_name_or_path"] = str(_family(work, "llama"))
        path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize("recipe", [*REAL, "alpaca"])
def test_real_model_recipes_and_templates_train_a_few_steps(work, assets, recipe):
    if recipe == "alpaca":
        path, extra = _alpaca_recipe(work), []
    else:
        path, extra = REPO / "recipes" / recipe, _path_overrides(work, recipe)
    run = f"run_{recipe.split('.')[0]}"
    result = ckpt_train(work, assets, *extra, *SHORT, *_cache(work), "--checkpoint.checkpoint_dir", run, recipe=path)
    assert re.search(rf"Saving checkpoint to {run}/epoch_\d+_step_2", result.stdout)  # a small corpus streams epochs
    values = losses(work / run)
    assert len(values) == 2 and all(v > 0 for v in values)
    if "streamed corpus" not in result.stdout:  # a stream cuts documents into sequences by design
        assert "0 truncated" in result.stdout  # examples (SFT), responses (preference pairs)


@pytest.mark.parametrize("recipe", [p.name for p in RECIPES])
def test_every_recipe_passes_dry_run(work, recipe, capsys):
    extra = _path_overrides(work, recipe) if recipe in REAL else []
    assert cli.main([str(REPO / "recipes" / recipe), "--dry-run", *extra]) == 0
    assert "recipe:" in capsys.readouterr().out
