"""tools/bench_async.py, bench_scale.py and bench_memory.py in their small modes: they run, and their reports hold
what they promise (the ratios, every phase at every rank count). Correctness of the output, not speed."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def _run(tool: str, *args: str, timeout: int = 900) -> str:
    proc = subprocess.run([sys.executable, str(TOOLS / tool), *args], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return proc.stdout


def test_bench_async_small_reports_stall_and_run_overhead(tmp_path):
    out = tmp_path / "async.json"
    printed = _run("bench_async.py", "--small", "--nproc", "1", "--modes", "none,sync,async", "--json", str(out))
    report = json.loads(out.read_text())
    assert math.isfinite(report["stall_over_sync"]) and report["stall_over_sync"] > 0
    assert report["stall_over_sync"] == pytest.approx(report["async_stall_seconds"] / report["sync_save_seconds"])
    for mode in ("sync", "async"):
        lost = report[f"run_overhead_{mode}"]
        assert math.isfinite(lost) and lost < 1 and math.isfinite(report[f"cpu_per_checkpoint_{mode}"])
        [run] = report["runs"][mode]  # one repetition in the small mode
        assert [s["step"] for s in run["saves"]] == [2, 4, 5] and run["saves"][-1]["final"]
        assert len(run["steps"]) == 5 and run["cpu_seconds"] > 0
    for save in report["runs"]["async"][0]["saves"]:
        assert save["stall"] == pytest.approx(save["call"] + save["fence"]) and save["fence"] >= 0
        assert save["capture"] is not None and save["background"] is not None  # the copy and write were timed
    assert all(s["background"] is None and s["call"] < 0.01 for s in report["runs"]["none"][0]["saves"])
    assert "stall_over_sync (median, steady state)" in printed and "| async |" in printed


def test_bench_scale_small_reports_every_phase_per_rank_count(tmp_path):
    out = tmp_path / "scale.json"
    printed = _run("bench_scale.py", "--small", "--json", str(out))
    report = json.loads(out.read_text())
    assert report["ranks"] == [2, 3]
    for phase in ("reserve", "plan_local", "plan_global", "write_sharded", "manifest", "publish", "save", "load"):
        row = report["phases"][phase]
        assert set(row) == {"2", "3"} and all(v >= 0 for v in row.values()), phase
        assert phase in report["growth"]
    sent = report["phases"]["object_bytes"]  # what object collectives moved per rank and save: plans, checksums
    assert 0 < sent["2"] < sent["3"] <= 1.5 * 1.5 * sent["2"]  # no faster than the rank count
    assert sent["3"] < 1 << 20  # metadata-sized
    assert "| manifest (s) |" in printed


def test_bench_memory_small_reports_the_setup_peak_against_the_ranks_share(tmp_path):
    out = tmp_path / "memory.json"
    printed = _run("bench_memory.py", "--size", "20MB", "--nprocs", "1", "--steps", "1", "--work", str(tmp_path),
                   "--json", str(out))
    report = json.loads(out.read_text())
    [run] = [r for r in report["runs"] if not r["activation_checkpointing"]]
    [rank] = run["ranks"]
    assert rank["base_bytes_read"] == report["size_bytes"]  # one rank: the whole base, read once
    assert rank["idle"] < rank["setup_peak"] <= rank["steps_peak"] and run["first_step_seconds"] > 0
    assert rank["params_share"] == 4 * rank["local_params"] and run["setup_goal_met"]  # <= 1.25 x share + 256 MiB
    assert "setup peak MiB" in printed


def test_bench_memory_setup_only_stops_before_the_first_step(tmp_path):
    out = tmp_path / "memory.json"
    printed = _run("bench_memory.py", "--size", "20MB", "--nprocs", "1", "--steps", "0", "--work", str(tmp_path),
                   "--json", str(out))
    [run] = [r for r in json.loads(out.read_text())["runs"] if not r["activation_checkpointing"]]
    [rank] = run["ranks"]
    assert "steps_peak" not in rank and rank["steps_over_state"] is None  # no step was taken
    assert rank["idle"] < rank["setup_peak"] and rank["base_bytes_read"] > 0
    assert "setup done" in printed
