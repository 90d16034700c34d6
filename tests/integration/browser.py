"""Headless Chromium (Debian's ``chromium``) on a report page: loaded offline with every host unresolvable, its DOM,
console and requests checked, and a screenshot that is not blank. A test that needs it skips where it is missing
(``tools/setup.sh`` installs it in CI)."""

from __future__ import annotations

import re
import shutil
import subprocess
import zlib
from pathlib import Path

import pytest

from automodel_ckpt.report import write
from tests.hostile.report_folder import Page, code_in

CHROMIUM = shutil.which("chromium")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (apt-get install chromium)")
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


def loads_cleanly(page: Path, tmp_path: Path) -> str:
    """``page`` in the browser: no console message, no request, each panel; a screenshot that is not blank.
    Returns the text the page shows."""
    text = page.read_text(encoding="utf-8")
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:|//)""", text, re.I)  # nothing to fetch
    loaded = chromium(page, tmp_path, "--dump-dom")
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert "CONSOLE" not in loaded.stderr, loaded.stderr[-2000:]  # no console error, no CSP violation
    assert not re.search(r"net::ERR_|NOTFOUND", loaded.stderr), loaded.stderr[-2000:]  # no request made
    dom = loaded.stdout
    for panel in PANELS:
        assert f"<h2>{panel}</h2>" in dom, panel
    assert code_in(dom) == []
    shot = tmp_path / "page.png"
    taken = chromium(page, tmp_path, f"--screenshot={shot}", "--window-size=1100,1400", "--hide-scrollbars")
    assert taken.returncode == 0 and shot.is_file(), taken.stderr[-2000:]
    assert len(pixels(shot.read_bytes())) > 16  # text, lines and colours, not a blank page
    return "".join(Page(dom).text)


def report_shows(run: Path, tmp_path: Path, *data: str) -> str:
    """The report of ``run`` written and loaded cleanly (``loads_cleanly``), each of ``data`` shown on it."""
    page = write(run, tmp_path / "report.html")
    shown = loads_cleanly(page, tmp_path)
    for item in data:
        assert item in shown, item
    return shown
