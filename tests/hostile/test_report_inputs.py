"""``ckpt-train report`` on a folder someone sent: every string renders as text, and the logs are read within bounds.

The crafted folder (``report_folder.hostile_run``) plants ``<script>``, an ``onerror=`` attribute, an ``<img>``
tag, a ``javascript:`` URL and control characters in every string the report reads. The page holds no element or
attribute that could run code or load anything, and shows each payload as text. A 200 MB training log is sampled,
not read whole.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from automodel_ckpt.cli import main
from automodel_ckpt.report import render
from tests.hostile.report_folder import ATTR, IMG, JS_URL, SCRIPT, Page, code_in, hostile_run


def test_every_string_of_a_hostile_run_folder_renders_as_text(tmp_path):
    text = render(hostile_run(tmp_path))
    assert code_in(text) == []
    shown = "".join(Page(text).text)
    for payload in (SCRIPT, ATTR, IMG, JS_URL, "\\x1b]0;pwned\\x07\\x00\\u2028"):
        assert payload in shown, payload  # as text, escaped where it is a control character
    assert "ckpt-train report: run" in re.search(r"<title>(.*?)</title>", text).group(1)
    for panel in ("Curves", "Eval scores", "Checkpoints", "Data", "Cost", "Algorithm", "Lineage"):
        assert f"<h2>{panel}</h2>" in text
    assert "deleted (line)" in text and "quarantined (line)" in text  # step 4 saved, since deleted; 3 quarantined
    assert "stages not readable" in shown  # a stage named with markup fails its check: said in one line


def test_the_page_checker_sees_each_way_to_run_code():
    for planted in ("<script>x</script>", '<img src="x">', '<p onclick="x">', '<a href="javascript:x">',
                    '<a href="https://example.com">', "<iframe></iframe>", "\x07"):
        assert code_in(f"<p>{planted}</p>"), planted
    assert code_in('<a href="#cost">cost</a><svg><line x1="1"></line></svg>') == []


def test_a_200_mb_training_log_is_sampled_not_read_whole(tmp_path):
    """Its records at evenly spaced places (a sparse file: a reader that reads it whole reads 200 MB)."""
    run = tmp_path / "run"
    run.mkdir()
    size = 200 * 2**20
    with open(run / "training.jsonl", "wb") as f:
        f.truncate(size)
        for i in range(50):  # a record every 4 MB, each after a newline
            f.seek(i * size // 50)
            f.write(b"\n" + json.dumps({"step": i + 1, "loss": 1.0 / (i + 1)}).encode() + b"\n")

    def read_bytes() -> int:
        return int(re.search(r"rchar: (\d+)", Path("/proc/self/io").read_text()).group(1))

    before = read_bytes()
    text = render(run)
    assert read_bytes() - before < 40 * 2**20
    assert "training.jsonl is 200 MiB" in text and "records read at evenly spaced places" in text
    assert "training loss" in text  # the records it met are plotted


def test_the_verb_on_a_hostile_folder_writes_the_page_and_names_it(tmp_path, capsys):
    run = hostile_run(tmp_path)
    assert main(["report", str(run), "-o", str(tmp_path / "page.html")]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'page.html'}"
    assert code_in((tmp_path / "page.html").read_text(encoding="utf-8")) == []


def test_a_long_curve_is_drawn_whole_while_a_long_string_from_the_folder_is_cut(tmp_path):
    """A chart's points are the page's own numbers: never cut as a string read from the folder is (300 steps drew
    35 points and a broken attribute a browser refuses)."""
    run = tmp_path / "run"
    run.mkdir()
    name = "n" * 5000
    (run / "training.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0 / s, name: 1.0}) + "\n"
                                                for s in range(1, 301)))
    text = render(run)
    lines = re.findall(r'<polyline points="([^"]*)"', text)
    assert lines and all(re.fullmatch(r"(-?[\d.]+,-?[\d.]+ ){299}-?[\d.]+,-?[\d.]+", p) for p in lines[:1]), lines[:1]
    assert name not in text
