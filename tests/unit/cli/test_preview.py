"""`ckpt-train preview` shows the rows training refuses: cut examples marked, the refusal as one warning line."""

from __future__ import annotations

import re
import sys
import warnings
from pathlib import Path

import pytest

from automodel_ckpt.cli import main
from automodel_ckpt.config.loader import load_config
from automodel_ckpt.config.schema import RecipeConfig
from automodel_ckpt.errors import ConfigError

REPO = Path(__file__).resolve().parents[3]
CHAT_RECIPE = str(REPO / "recipes" / "tiny_llama_chat.yaml")


@pytest.fixture(scope="module")
def overrides(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The chat recipe on 300 chats (20 held out), its embedded base and tokenization cache in a temporary folder."""
    root = tmp_path_factory.mktemp("preview")
    return ["--dataset.num_samples", "300", "--data.val_size", "20", "--data.cache_dir", str(root / "cache"),
            "--model.pretrained_model_name_or_path", str(root / "tiny_llama_base")]


@pytest.fixture
def warnings_to_stderr(monkeypatch: pytest.MonkeyPatch) -> None:
    """Warnings printed as the CLI prints them outside pytest (pytest records them instead)."""
    def show(message, category, filename, lineno, file=None, line=None):
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))

    monkeypatch.setattr(warnings, "showwarning", show)


def _said(err: str) -> list[str]:
    """The ``warning:`` and ``error:`` lines of stderr (in-process, the datasets library may have drawn progress bars
    there too, once something else imported it first)."""
    return [line for line in err.splitlines() if line.startswith(("warning:", "error:"))]


def _preview(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[str, list[str]]:
    capsys.readouterr()
    assert main(["preview", CHAT_RECIPE, *argv]) == 0
    captured = capsys.readouterr()
    return captured.out, _said(captured.err)


def test_preview_shows_the_cut_rows_that_training_refuses_and_warns(capsys, overrides, warnings_to_stderr):
    out, err = _preview(capsys, [*overrides, "--data.seq_length", "8", "--num", "2"])
    assert len(err) == 1, err
    m = re.fullmatch(r"warning: data\.seq_length: 8 tokens leave no token with a loss in the 280 training examples "
                     r"\(280 cut short\); --data\.seq_length (\d+) keeps 95% of them whole", err[0])
    assert m, err
    heads = [line for line in out.splitlines() if line.startswith("── row ")]
    assert len(heads) == 2 and all(h.endswith("8/8 tokens · 0 with loss · cut short ✂") for h in heads), out
    rows = [line for line in out.splitlines() if line.startswith("    <s>")]
    assert len(rows) == 2 and all(r.endswith("✂") and "«" not in r for r in rows), out
    assert "train: 280 examples" in out and "(0 with loss), 280 truncated examples" in out

    from automodel_ckpt.data.pipeline import prepare_data
    from automodel_ckpt.models.build import build_tokenizer

    cfg = load_config(CHAT_RECIPE, [*overrides, "--data.seq_length", "8"], RecipeConfig)
    with pytest.raises(ConfigError) as refused:  # training still refuses, with the very line preview warns
        prepare_data(cfg, build_tokenizer(cfg.model.pretrained_model_name_or_path))
    assert f"warning: {refused.value}" == err[0]


def test_preview_marks_only_the_examples_that_are_cut_and_warns_about_the_share(capsys, overrides,
                                                                                warnings_to_stderr):
    out, err = _preview(capsys, [*overrides, "--data.seq_length", "28", "--num", "3"])
    assert len(err) == 1 and re.fullmatch(r"warning: data\.seq_length 28 cuts \d+ of 280 training examples \(\d+%\) "
                                          r"short; --data\.seq_length \d+ keeps 95% of them whole", err[0]), err
    lines = out.splitlines()
    pairs = [(lines[i], lines[i + 1]) for i, line in enumerate(lines) if line.startswith("── row ")]
    assert len(pairs) == 3
    for head, row in pairs:  # 28 tokens hold the prompt and part or all of the answer
        assert "«" in row and head.endswith("cut short ✂") == row.endswith("✂"), (head, row)
        assert row.endswith("</s>»") != row.endswith("✂"), row  # whole: the end of text is trained; cut: no end
    assert any(row.endswith("✂") for _, row in pairs) and any(not row.endswith("✂") for _, row in pairs), out


def test_preview_of_a_recipe_whose_validation_split_takes_everything_is_still_an_error(capsys, overrides):
    capsys.readouterr()
    assert main(["preview", CHAT_RECIPE, *overrides, "--data.val_size", "300"]) == 2
    assert _said(capsys.readouterr().err) == ["error: data.val_size: 300 leaves no training data (300 examples)"]


def test_preview_of_a_tensor_parallel_recipe_checks_it_as_for_its_smallest_run(capsys, overrides):
    out, _ = _preview(capsys, [*overrides, "--distributed.tp_size", "2", "--num", "1"])
    assert out.startswith("First 1 of 280 train sequences")
    from automodel_ckpt.cli.preview import smallest_world_size

    assert smallest_world_size({"tp_size": 2, "dp_replicate_size": 2}) == 4
    assert smallest_world_size({"tp_size": 2, "dp_size": 3, "dp_replicate_size": 3}) == 6
    assert smallest_world_size({"tp_size": "x", "dp_size": None}) == 1  # the check names the bad value itself


def test_a_preference_recipe_shows_each_pair_with_both_responses_scored(overrides, capsys):
    recipe = str(REPO / "recipes" / "tiny_llama_dpo.yaml")
    capsys.readouterr()
    assert main(["preview", recipe, "-n", "1", "--dataset.num_samples", "40", "--validation_dataset.num_samples", "4",
                 *overrides[4:]]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert not _said(captured.err)
    lines = out.splitlines()
    assert lines[0].startswith("First 1 of 40 train pairs; the scored text")
    pair = lines[lines.index(next(x for x in lines if x.startswith("══ pair 0"))):][:5]
    chosen, rejected = pair[2].strip(), pair[4].strip()
    prompt = chosen.split("«")[0]
    assert prompt.endswith("=") and rejected.startswith(prompt)  # one prompt, context only
    a, b = (int(x) for x in prompt.removeprefix("<s>").rstrip("=").split("+"))
    assert chosen == f"{prompt}«{a + b}</s>»" and rejected != chosen
    assert "data: 40 training pairs (text)" in out
