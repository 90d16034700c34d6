"""Every verb on one shared layer: listed by --help, --debug accepted, bad arguments one line with exit code 2."""

from __future__ import annotations

import importlib

import pytest

from automodel_ckpt.cli import VERBS, main, usage
from automodel_ckpt.cli.common import human_size

POSITIONAL = {"consolidate": "ckpt", "inspect": "dir", "merge-lora": "ckpt", "verify": "path", "plot": "dir",
              "preview": "recipe.yaml", "gc": "s3://bucket/run", "pack": "ckpt",
              "export": "ckpt", "average": "ckpt", "eval": "ckpt",
              "import": ("checkpoint-6", "recipe.yaml", "--out", "run"), "diff": ("a", "b"), "report": "run",
              "env": ()}


def test_help_lists_every_verb(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out == usage()
    for verb in VERBS:
        assert f"ckpt-train {verb} " in out
    assert set(POSITIONAL) == set(VERBS)  # a new verb gets its row below


@pytest.mark.parametrize("verb", sorted(POSITIONAL))
def test_every_verb_takes_debug(verb):
    module = importlib.import_module(f"automodel_ckpt.cli.{VERBS[verb][0]}")
    given = POSITIONAL[verb]
    args = module.build_parser().parse_args([*(given if isinstance(given, tuple) else [given]), "--debug"])
    assert args.debug is True


@pytest.mark.parametrize("verb", sorted(POSITIONAL))
@pytest.mark.parametrize("argv", [["--no-such-flag"], []], ids=["unknown-flag", "missing-argument"])
def test_bad_arguments_are_one_line_and_exit_2(verb, argv, capsys, monkeypatch):
    monkeypatch.delenv("AUTOMODEL_CKPT_DEBUG", raising=False)
    given = POSITIONAL[verb]
    if not argv and not given:
        pytest.skip(f"{verb} takes no argument")
    full = [verb, *([given] if given else []), *argv] if argv else [verb]
    assert main(full) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and f"usage: ckpt-train {verb}" in err


def test_one_size_format():
    assert [human_size(n) for n in (0, 1023, 1536, 5 * 2**30)] == ["0 B", "1023 B", "1.5 KiB", "5.0 GiB"]
    for module in ("inspect", "verify"):
        assert importlib.import_module(f"automodel_ckpt.cli.{module}").human_size is human_size


def test_python_dash_m_runs_the_same_main():
    import automodel_ckpt.__main__ as entry

    assert entry.main is main
