"""Every `ckpt-train` command shown in README.md and docs/ is valid: training commands pass `--dry-run`."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from automodel_ckpt.cli import VERBS, main

REPO = Path(__file__).resolve().parents[2]


def _code_blocks(text: str) -> list[str]:
    """Contents of fenced code blocks (``` lines toggle), except Python and YAML ones."""
    blocks, current, lang = [], None, ""
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            if current is None:
                current, lang = [], line.strip()[3:].strip()
            else:
                if lang not in ("python", "yaml"):
                    blocks.append("\n".join(current))
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def documented_commands() -> list[tuple[str, list[str], bool]]:
    """(where, arguments, whether the docs show it failing) for each command in a fenced block."""
    found = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for block in _code_blocks(doc.read_text(encoding="utf-8")):
            lines = [line.strip() for line in block.replace("\\\n", " ").splitlines()]
            for i, line in enumerate(lines):
                line = re.sub(r"^.*&&\s*", "", line.removeprefix("$ "))  # `bash tools/setup.sh && ckpt-train ...`
                m = re.match(r"^(?:\S*/)?ckpt-train\s+(.*)$", line)
                if m:
                    args = shlex.split(m.group(1).split(" #")[0])
                    shows_error = i + 1 < len(lines) and lines[i + 1].startswith("error:")
                    found.append((f"{doc.name}: {line}", args, shows_error))
    return found


COMMANDS = documented_commands()


def _user_folder(arg: str, tmp_path: Path) -> str:
    """Docs create model folders under ``my-models/`` in an example before training on them: stand one in."""
    if not arg.startswith("my-models/"):
        return arg
    folder = tmp_path / arg
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text("{}")
    return str(folder)


def test_docs_show_commands():
    assert len(COMMANDS) >= 10
    assert any(shows_error for _, _, shows_error in COMMANDS)


@pytest.mark.parametrize("where,args,shows_error", COMMANDS, ids=[c[0][:90] for c in COMMANDS])
def test_documented_command_is_valid(where, args, shows_error, monkeypatch, tmp_path, capsys):
    """Training commands are checked with --dry-run; utility verbs must exist (each has its own integration test)."""
    if args[0] in VERBS:
        return
    recipe = next(a for a in args if a.endswith(".yaml"))
    assert (REPO / recipe).exists(), f"{where}: recipe {recipe} does not exist"
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("AUTOMODEL_CKPT_ASSETS", str(tmp_path))
    args = [_user_folder(a, tmp_path) for a in args]
    code = main(["--dry-run", *args])
    err = capsys.readouterr().err
    if shows_error:
        assert code != 0 and err.startswith("error:"), where
    else:
        assert code == 0, f"{where}\n{err}"
