"""``ckpt-train report`` in a real browser: a run trained with ``logging.report: true`` has its page, which headless
Chromium loads with no console message and no network request, every panel present with its data, and a screenshot
that is not blank; the page of a hostile run folder runs nothing. Skipped where Debian's ``chromium`` is not installed
(tools/setup.sh installs it in CI)."""

from __future__ import annotations

import re
import shutil
import subprocess
import zlib
from pathlib import Path

import pytest

from automodel_ckpt.report import render
from tests.hostile.report_folder import Page, code_in, hostile_run
from tests.integration.harness import ckpt_train

CHROMIUM = shutil.which("chromium")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (apt-get install chromium)")
PANELS = ("Curves", "Eval scores", "Checkpoints", "Data", "Cost", "Algorithm", "Lineage")


def chromium(page: Path, tmp_path: Path, *flags: str) -> subprocess.CompletedProcess:
    """Headless Chromium on ``page``, every host name unresolvable (a request would fail and be logged)."""
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0",
           "--host-resolver-rules=MAP * ~NOTFOUND", f"--user-data-dir={tmp_path / 'profile'}", "--no-first-run",
           "--disable-extensions", "--disable-background-networking", "--disable-component-update", *flags,
           page.as_uri()]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=90)


def pixels(png: bytes) -> set[int]:
    """The distinct byte values of a PNG's decoded rows (a blank page has two or three)."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    data, at = b"", 8
    while at < len(png):
        length = int.from_bytes(png[at:at + 4], "big")
        if png[at + 4:at + 8] == b"IDAT":
            data += png[at + 8:at + 8 + length]
        at += 12 + length
    return set(zlib.decompress(data))


@pytest.fixture(scope="module")
def reported_run(tmp_path_factory, assets) -> tuple[Path, str]:
    """A tiny run (1 process, 4 steps, a checkpoint every 2) with ``logging.report: true``: its folder, its output."""
    cwd = tmp_path_factory.mktemp("reported")
    done = ckpt_train(cwd, assets, "--step_scheduler.max_steps", "4", "--step_scheduler.ckpt_every_steps", "2",
                      "--checkpoint.save_consolidated", "false", "--data.val_size", "8", "--logging.report", "true",
                      "--checkpoint.checkpoint_dir", "run")
    return cwd / "run", done.output


def test_the_page_of_a_run_loads_offline_with_every_panel_and_no_console_message(reported_run, tmp_path):
    run, output = reported_run
    page = run / "report.html"
    assert f"Report: {page}" in output or "Report: run/report.html" in output  # the start line says where
    text = page.read_text(encoding="utf-8")
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:|//)""", text, re.I)  # nothing to fetch
    loaded = chromium(page, tmp_path, "--dump-dom")
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert "CONSOLE" not in loaded.stderr, loaded.stderr[-2000:]  # no console error, no CSP violation
    assert not re.search(r"net::ERR_|NOTFOUND", loaded.stderr), loaded.stderr[-2000:]  # no request made
    dom = loaded.stdout
    for panel in PANELS:
        assert f"<h2>{panel}</h2>" in dom, panel
    shown = "".join(Page(dom).text)
    for data in ("training loss", "validation loss", "epoch_0_step_2", "epoch_0_step_4", "sizes match",
                 "launches:", "lineage of", "base model"):
        assert data in shown, data
    assert dom.count("<polyline") >= 3 and code_in(dom) == []
    shot = tmp_path / "page.png"
    taken = chromium(page, tmp_path, f"--screenshot={shot}", "--window-size=1100,1400", "--hide-scrollbars")
    assert taken.returncode == 0 and shot.is_file(), taken.stderr[-2000:]
    assert len(pixels(shot.read_bytes())) > 16  # text, lines and colours, not a blank page


def test_the_page_of_a_hostile_folder_runs_nothing_in_the_browser(tmp_path):
    page = tmp_path / "hostile.html"
    page.write_text(render(hostile_run(tmp_path)), encoding="utf-8")
    loaded = chromium(page, tmp_path, "--dump-dom")
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert "CONSOLE" not in loaded.stderr and "alert" not in loaded.stderr.lower()
    assert code_in(loaded.stdout) == []  # no element or attribute a payload would have added
    assert re.search(r"<title>(.*?)</title>", loaded.stdout).group(1) == "ckpt-train report: run"
    # the checks see a script that runs: it changes the title, adds an element and writes to the console
    control = tmp_path / "control.html"
    control.write_text("<title>t</title><body><script>document.title='ran';console.error('ran');"
                       "document.body.appendChild(document.createElement('marquee'))</script></body>")
    ran = chromium(control, tmp_path, "--dump-dom")
    assert "<title>ran</title>" in ran.stdout and code_in(ran.stdout) and "CONSOLE" in ran.stderr
