"""``ckpt-train report`` in a real browser: a run trained with ``logging.report: true``, killed mid-run and resumed,
has its page, which headless Chromium loads with no console message and no network request, every panel present
with its data, and a screenshot that is not blank; the page of a hostile run folder runs nothing. (The DPO and GRPO
runs' pages are loaded by ``test_dpo.py`` and ``test_grpo.py``, from their own runs.) Skipped where Debian's
``chromium`` is not installed (tools/setup.sh installs it in CI)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from automodel_ckpt.report import render
from tests.hostile.report_folder import code_in, hostile_run
from tests.integration import step_faults
from tests.integration.browser import chromium, loads_cleanly, needs_chromium, pixels
from tests.integration.harness import CKPT_TRAIN, QUIET, RECIPE, REPO, ckpt_train, env_for, kill_job, start_command

pytestmark = needs_chromium
ARGS = ("--step_scheduler.max_steps", "4", "--step_scheduler.ckpt_every_steps", "2", "--checkpoint.save_consolidated",
        "false", "--data.val_size", "8", "--logging.report", "true", "--checkpoint.checkpoint_dir", "run")


@pytest.fixture(scope="module")
def reported_run(tmp_path_factory, assets) -> tuple[Path, str]:
    """A tiny run (1 process, 4 steps, a checkpoint every 2) with ``logging.report: true``, held after step 3 and
    killed (SIGKILL), then rerun to its end from step 2's checkpoint: its folder, the rerun's output."""
    cwd = tmp_path_factory.mktemp("reported")
    hold = step_faults.env(3, cwd / "held.pid")
    with open(cwd / "killed.log", "w") as log:
        job = start_command([CKPT_TRAIN, str(RECIPE), *QUIET, *ARGS, "--recipe", step_faults.RECIPE], cwd=cwd,
                            env=env_for(assets, hold), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        held = step_faults.stopped(Path(hold["STOP_PID_FILE"]), job)
    finally:
        kill_job(job)
    assert held is not None, (cwd / "killed.log").read_text()[-3000:]
    done = ckpt_train(cwd, assets, *ARGS)
    assert "Loading checkpoint from run/epoch_0_step_2" in done.output
    return cwd / "run", done.output


def test_the_page_of_a_killed_and_resumed_run_loads_offline_with_every_panel_and_no_console_message(reported_run,
                                                                                                     tmp_path):
    run, output = reported_run
    page = run / "report.html"
    assert f"Report: {page}" in output or "Report: run/report.html" in output  # the start line says where
    shown = loads_cleanly(page, tmp_path)
    for data in ("training loss", "validation loss", "epoch_0_step_2", "epoch_0_step_4", "sizes match",
                 "launches:", "lineage of", "base model"):
        assert data in shown, data
    assert re.search(r"launches:\s*2", shown), shown[:3000]  # the kill and the resume
    assert page.read_text(encoding="utf-8").count("<polyline") >= 3


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


def test_the_docs_screenshot_tool_draws_each_panel_alone(reported_run, tmp_path):
    run, _ = reported_run
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import report_screenshots
    finally:
        sys.path.pop(0)
    assert report_screenshots.main([str(run), "--out", str(tmp_path / "shot"), "--panels", "cost,curves"]) == 0
    for anchor in ("cost", "curves"):
        assert len(pixels((tmp_path / f"shot_{anchor}.png").read_bytes())) > 16, anchor  # drawn, not blank
