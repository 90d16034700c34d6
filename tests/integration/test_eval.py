"""`ckpt-train eval` and `ckpt-train average` on real checkpoints: the shipped task scores as examples/generate.py does,
a 2-process checkpoint scores the same as saved and consolidated, `average --last 3` is the mean of the shards."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.integration.harness import REPO, ckpt_train

sys.path.insert(0, str(REPO / "examples"))
LIMIT = 100  # examples/generate.py's default --n: the task file's first 100 rows are its problems


@pytest.fixture(scope="module")
def run(tmp_path_factory, assets) -> Path:
    """The default recipe for 60 steps on 1 process, a checkpoint every 20 (the last one exported as the recipe
    exports it): a few answers right, enough to tell two scorers apart."""
    work = tmp_path_factory.mktemp("eval_run")
    ckpt_train(work, assets, "--step_scheduler.max_steps", "60", "--step_scheduler.ckpt_every_steps", "20",
               "--step_scheduler.val_every_steps", "1000", "--data.val_size", "16",
               "--checkpoint.checkpoint_dir", "run")
    return work / "run"


def _shard_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted((checkpoint / "model").glob("shard-*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def test_eval_of_the_final_checkpoint_scores_as_generate_py(run, capsys):
    from evaluation import generate_answers  # examples/evaluation.py, what examples/generate.py scores with
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from automodel_ckpt.cli import main
    from automodel_ckpt.data.builtin import heldout_examples

    final = run / "epoch_0_step_60"
    assert main(["eval", str(final), "--tasks", "addition", "--limit", str(LIMIT), "--log-samples"]) == 0
    out = capsys.readouterr().out
    assert "exact_match" in out and "addition" in out
    saved = json.loads((final / "eval" / "addition.json").read_text())
    score = saved["results"]["addition"]["exact_match,none"]
    samples = saved["samples"]["addition"]

    export = final / "model" / "consolidated"  # what examples/generate.py reads
    model, tokenizer = AutoModelForCausalLM.from_pretrained(export), AutoTokenizer.from_pretrained(export)
    problems = heldout_examples(LIMIT)
    answers = generate_answers(model, tokenizer, [p for p, _ in problems])
    assert score == sum(a == want for a, (_, want) in zip(answers, problems)) / LIMIT  # generate.py's accuracy
    # answer by answer, not only the count: the harness's greedy answers are generate.py's, on the same problems
    assert [s["doc"]["prompt"] for s in samples] == [p for p, _ in problems]
    assert [s["filtered_resps"][0] for s in samples] == answers
    assert main(["verify", str(final), "--quiet"]) == 0  # the checkpoint's manifest lists eval/


def test_a_two_process_checkpoint_scores_the_same_as_saved_and_consolidated(straight_runs, tmp_path):
    from automodel_ckpt.cli import main
    from automodel_ckpt.evaluation.harness import EvalSettings, evaluate, load_model

    source = sorted(straight_runs.get(2).glob("epoch_*"))[-1]
    checkpoint = tmp_path / source.name
    shutil.copytree(source, checkpoint, symlinks=True)  # the shared run stays as it is
    assert len(list((checkpoint / "model").glob("shard-*.safetensors"))) == 2
    assert main(["consolidate", str(checkpoint), "--out", str(tmp_path / "hf"), "--no-progress"]) == 0
    settings = EvalSettings(("addition",), limit=40)
    answers = []
    for src in (checkpoint, tmp_path / "hf"):
        with load_model(src) as (model, tokenizer):
            results = evaluate(model, tokenizer, settings, log_samples=True)
        answers.append(([s["filtered_resps"][0] for s in results["samples"]["addition"]],
                        results["results"]["addition"]["exact_match,none"]))
    assert answers[0] == answers[1]


def test_average_last_3_is_the_mean_of_the_shards_and_loads_in_transformers(run, tmp_path):
    from transformers import AutoModelForCausalLM

    from automodel_ckpt.cli import main

    out = tmp_path / "avg"
    assert main(["average", "--last", "3", str(run), "--out", str(out), "--dtype", "fp32"]) == 0
    with safe_open(str(next(out.glob("model-*.safetensors"))), framework="pt") as f:
        got = {k: f.get_tensor(k) for k in f.keys()}
    checkpoints = [run / f"epoch_0_step_{s}" for s in (20, 40, 60)]
    shards = [_shard_tensors(c) for c in checkpoints]
    assert set(got) == set(shards[0]) and len(got) > 10
    for name, tensor in got.items():
        # each checkpoint's tensor as saved (float32, not cast to the base's bf16 first), the mean in float32
        parts = [s[name].float() for s in shards]
        assert all(s[name].dtype == torch.float32 for s in shards)
        torch.testing.assert_close(tensor, (parts[0] + parts[1] + parts[2]) / 3, rtol=1.2e-7, atol=0)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(model.state_dict()["lm_head.weight"], got["lm_head.weight"])
