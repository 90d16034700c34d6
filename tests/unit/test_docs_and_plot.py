"""The generated config reference is current, links between the docs resolve, and `ckpt-train plot` draws what
it should."""

from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path

from automodel_ckpt.cli import main
from automodel_ckpt.cli.plot import make_figure

REPO = Path(__file__).resolve().parents[2]


def render_reference() -> str:
    """The reference ``tools/gen_config_reference.py`` writes."""
    spec = importlib.util.spec_from_file_location("gen_config_reference", REPO / "tools" / "gen_config_reference.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool.render_reference()


def test_config_reference_is_in_sync():
    committed = (REPO / "docs" / "config-reference.md").read_text(encoding="utf-8")
    assert committed == render_reference(), "run: python tools/gen_config_reference.py"


def test_config_reference_lists_every_checkpoint_key():
    from dataclasses import fields

    from automodel_ckpt.checkpoint.config import CheckpointConfig

    text = render_reference()
    for f in fields(CheckpointConfig):
        assert f"`checkpoint.{f.name}`" in text


def _fake_run(root: Path) -> Path:
    run = root / "run"
    run.mkdir()
    with (run / "training.jsonl").open("w") as f:
        for step in range(1, 9):
            f.write(json.dumps({"step": step, "epoch": 0, "loss": 4.0 / step, "lr": 1e-3 * step}) + "\n")
    with (run / "validation.jsonl").open("w") as f:
        for step, val in ((4, 1.5), (8, 1.1)):
            f.write(json.dumps({"step": step, "val_loss": val}) + "\n")
    for step, val in ((4, 1.5), (8, 1.1)):
        ckpt = run / f"epoch_0_step_{step}"
        ckpt.mkdir()
        (ckpt / "metadata.json").write_text(json.dumps({"step": step, "epoch": 0, "val_loss": val}))
    os.symlink("epoch_0_step_8", run / "LOWEST_VAL")
    os.symlink("epoch_0_step_8", run / "LATEST")
    return run



def test_relative_links_in_readme_and_docs_resolve():
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if "://" not in target and not target.startswith("mailto:") and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(REPO)} -> {target}")
    assert not broken, broken


def test_plot_has_labelled_axes_and_marks_checkpoints(tmp_path):
    fig = make_figure(_fake_run(tmp_path))
    ax, ax_lr = fig.axes
    assert ax.get_ylabel() == "loss" and ax_lr.get_xlabel() == "optimizer step" and ax_lr.get_ylabel() == "learning rate"
    labels = [line.get_label() for line in ax.get_lines()]
    assert "training loss" in labels and "validation loss" in labels
    assert "LOWEST_VAL (epoch_0_step_8)" in labels
    marks = [line for line in ax.get_lines() if line.get_linestyle() == ":"]
    assert sorted(line.get_xdata()[0] for line in marks) == [4, 8]


def test_plot_command_writes_png(tmp_path, capsys):
    run = _fake_run(tmp_path)
    assert main(["plot", str(run)]) == 0
    png = run / "loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {png}" in capsys.readouterr().out


def test_plot_without_logs_is_a_clear_error(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) != 0
    assert "nothing to plot" in capsys.readouterr().err
