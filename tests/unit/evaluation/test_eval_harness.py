"""`ckpt-train eval`'s pieces: the shipped task's problems, what SRC means, where results go, refusals in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from automodel_ckpt.errors import CheckpointError, UserError
from automodel_ckpt.evaluation.harness import load_model, results_dir, targets, task_manager
from automodel_ckpt.evaluation.tasks.addition.problems import PROBLEMS_FILE, rows


def test_the_shipped_task_file_holds_the_recipes_held_out_problems_in_generate_pys_order():
    from automodel_ckpt.data.builtin import addition_problems, heldout_examples

    lines = [json.loads(line) for line in PROBLEMS_FILE.read_text().splitlines()]
    assert lines == rows()  # generated like the recipe's data (`python -m ...problems` writes it again)
    assert len(lines) == len(addition_problems("heldout"))
    for n in (100, 200):  # examples/generate.py --n N scores the file's first N problems
        assert [(r["prompt"], r["answer"]) for r in lines[:n]] == heldout_examples(n)


def test_the_shipped_task_is_found_without_scanning_the_registry():
    manager = task_manager(("addition",))
    assert manager.all_tasks == ["addition"]  # the harness's own registry is not read for it


def test_a_run_folder_means_its_checkpoints_and_results_go_beside_what_was_evaluated(tmp_path):
    run = tmp_path / "run"
    for step in (2, 4):
        (run / f"epoch_0_step_{step}" / "model").mkdir(parents=True)
    assert targets(run) == [run / "epoch_0_step_2", run / "epoch_0_step_4"]
    assert targets(run, ["epoch_0_step_4"]) == [run / "epoch_0_step_4"]
    with pytest.raises(UserError, match="no checkpoint 'epoch_0_step_9'"):
        targets(run, ["epoch_0_step_9"])
    checkpoint = run / "epoch_0_step_4"
    assert targets(checkpoint) == [checkpoint]
    with pytest.raises(UserError, match="does not exist"):
        targets(tmp_path / "missing")
    (checkpoint / "metadata.json").write_text("{}")
    assert results_dir(checkpoint / "model") == checkpoint
    assert results_dir(tmp_path / "export") == tmp_path / "export"
    (tmp_path / "model.tar").write_bytes(b"")
    assert results_dir(tmp_path / "model.tar") == tmp_path / "model.eval"


def _tiny_folder(folder: Path, layers: int = 2) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from automodel_ckpt.models.tiny import build_tokenizer

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    LlamaForCausalLM(config).save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    return folder


def test_the_model_is_built_from_the_tensors_and_a_config_larger_than_its_weights_is_refused(tmp_path):
    folder = _tiny_folder(tmp_path / "m")
    with load_model(folder) as (model, tokenizer):
        assert torch.equal(model.state_dict()["model.norm.weight"], torch.ones(32))
        assert model.name_or_path == str(folder) and tokenizer("1+2=").input_ids
    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] = 40  # the files hold 2 layers
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="does not fit the weights"):
        with load_model(folder):
            pass


def test_inspect_shows_the_scores_kept_in_a_checkpoint(tmp_path):
    from automodel_ckpt.cli.inspect import inspect_dir, render_table
    from automodel_ckpt.evaluation.harness import write_results

    run = tmp_path / "run"
    for step in (2, 4):
        (run / f"epoch_0_step_{step}" / "model").mkdir(parents=True)
    header = render_table(inspect_dir(run)).splitlines()[0]
    assert not header.endswith("EVAL")  # no column until a checkpoint is evaluated
    results = {"results": {"addition": {"alias": "addition", "exact_match,none": 0.25,
                                        "exact_match_stderr,none": 0.1}}, "versions": {"addition": 1.0}}
    (written,) = write_results(results, run / "epoch_0_step_4", ("addition",))
    assert written == run / "epoch_0_step_4" / "eval" / "addition.json"
    assert json.loads(written.read_text())["source"] == str(run / "epoch_0_step_4")
    rows = inspect_dir(run)["checkpoints"]
    assert [r["eval"] for r in rows] == [None, {"addition/exact_match": 0.25}]
    table = render_table(inspect_dir(run)).splitlines()
    assert table[0].endswith("EVAL") and table[2].endswith("addition/exact_match 0.2500") and table[1].endswith("-")


def test_results_are_never_written_through_a_link(tmp_path):
    from automodel_ckpt.evaluation.harness import write_results

    checkpoint, elsewhere = tmp_path / "epoch_0_step_2", tmp_path / "elsewhere"
    checkpoint.mkdir()
    elsewhere.mkdir()
    (checkpoint / "eval").symlink_to(elsewhere)  # planted in a received checkpoint
    with pytest.raises(CheckpointError, match="never written through a link"):
        write_results({"results": {"addition": {}}}, checkpoint, ("addition",))
    assert list(elsewhere.iterdir()) == []
